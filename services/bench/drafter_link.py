"""What one drafting call costs the verifier over the gRPC link, against the drafter's lookup alone.

Run: `python -m services.bench.drafter_link [--method ngram] [--rows 1 8 64] [--contexts 300 2000]`. A real
`specserve drafter` process is started on a free port; the verifier's end of the link (RemoteProposer) then sends
steps as the engine does (each sequence gains one token a step, so a step carries one new token a row) and the
round trip of each call is timed, after a warm-up. Beside it, the same proposer in this process, on the same
sequences, gives the lookup alone. Each case gets a fresh drafter and proposer (a suffix drafter's global tree
grows with every sequence it served). Medians. Random tokens: a lookup finds short matches, as on new text; the
in-process lookup is handed lists, as the in-process engine hands them, the drafter service its token views.

With `--method eagle` (or eagle3: the shipped heads, on --device, CPU by default) each sequence also carries the
target's hidden states, random, one row more a call, as the verifier sends them (float16 on the link), and the
in-process side is the same proposer reading them from memory: the difference is what the link and the drafter
process add to an EAGLE ask.

Why: on an accelerator a decode step of SmolLM2 takes about 3.4 ms (issue 29), so what asking the drafter costs
is a large share of a speculative step: on a 2-core EPYC the n-gram round trip was 1.1-1.7 ms at one row and
28-51 ms at 64 rows before the lookup and the drafter's token buffers were made cheap (0.7-0.8 and 4-8 ms after).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence

import torch

from services.bench.drafter_process import drafter_process
from services.bench.hardware import describe_hardware
from services.common.drafter_methods import build_proposer
from services.common.proposer import DraftInput
from services.common.speculative_config import SpeculativeConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig

STEPS = 300
WARM_UP = 50
VOCAB = 1000  # token ids drawn below this; the link's vocabulary check is told the same
K = 4


def sequences(rows: int, context: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"s{i}": [rng.randrange(VOCAB) for _ in range(context)] for i in range(rows)}


def random_states(seqs: dict[str, list[int]], width: int, steps: int) -> dict[str, torch.Tensor]:
    """Per sequence, target states for every token it will have ([context + steps, width]; a call reads a view)."""
    generator = torch.Generator().manual_seed(2)
    return {s: torch.randn(len(tokens) + steps, width, generator=generator) for s, tokens in seqs.items()}


async def timed_calls(proposer, rows: int, context: int, state_width: int = 0, steps: int = STEPS,
                      warm_up: int = WARM_UP) -> float:
    """Median seconds of one propose() over `rows` sequences that start at `context` tokens and grow by one a call;
    with `state_width`, each carries its hidden states (n - 1 rows for n tokens, as the verifier has them)."""
    rng = random.Random(1)
    seqs = sequences(rows, context)
    states = random_states(seqs, state_width, steps) if state_width else {}
    seconds = []
    for step in range(steps):
        inputs = [DraftInput(seq_id, tokens, K, states[seq_id][: len(tokens) - 1] if states else None)
                  for seq_id, tokens in seqs.items()]
        started = time.perf_counter()
        await proposer.propose(inputs)
        if step >= warm_up:
            seconds.append(time.perf_counter() - started)
        for tokens in seqs.values():
            tokens.append(rng.randrange(VOCAB))
    return statistics.median(seconds)


async def over_the_link(address: str, rows: int, context: int, capabilities, steps: int, warm_up: int) -> float:
    """timed_calls through a RemoteProposer, told the vocabulary and state width the drafter declared."""
    config = RemoteProposerConfig(target=address, vocab_size=capabilities.vocab_size or VOCAB,
                                  hidden_size=capabilities.hidden_size)
    proposer = await RemoteProposer.connect(config)
    try:
        return await timed_calls(proposer, rows, context, capabilities.state_width, steps, warm_up)
    finally:
        await proposer.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.drafter_link", description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="ngram",
                        help="ngram or suffix (no model), or eagle / eagle3 (the shipped heads)")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default: 1 8 64 (EAGLE: 1 8)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 2000])
    parser.add_argument("--device", default="cpu", help="where an EAGLE head runs (cpu, cuda, npu)")
    parser.add_argument("--dtype", default="float32", help="its dtype (float32, bfloat16, float16)")
    args = parser.parse_args(argv)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    eagle = args.method in ("eagle", "eagle3")
    rows_list = args.rows or ([1, 8] if eagle else [1, 8, 64])
    steps, warm_up = (60, 10) if eagle else (STEPS, WARM_UP)  # an EAGLE ask is milliseconds of head work here
    config = SpeculativeConfig(method=args.method, num_speculative_tokens=K,
                               **({"draft_device": args.device, "draft_dtype": args.dtype} if eagle else {}))
    argv_tail = ["--speculative-config", config.model_dump_json(exclude_defaults=True)]
    for context in args.contexts:
        for rows in rows_list:
            local_proposer = build_proposer(config)
            capabilities = local_proposer.capabilities
            local = asyncio.run(timed_calls(local_proposer, rows, context, capabilities.state_width, steps, warm_up))
            with drafter_process(argv_tail, lambda message: None) as (address, _):
                linked = asyncio.run(over_the_link(address, rows, context, capabilities, steps, warm_up))
            what = "the ask" if eagle else "the lookup"
            print(f"{args.method}, {rows:>3} rows of {context:>5} tokens: {linked * 1e3:6.2f} ms a call over the "
                  f"link, {local * 1e3:6.2f} ms {what} alone in process", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
