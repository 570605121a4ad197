"""What one drafting call costs the verifier over the gRPC link, against the drafter's lookup alone.

Run: `python -m services.bench.drafter_link [--method ngram] [--rows 1 8 64] [--contexts 300 2000]`. A real
`specserve drafter` process is started on a free port; the verifier's end of the link (RemoteProposer) then sends
steps as the engine does (each sequence gains one token a step, so a step carries one new token a row) and the
round trip of each call is timed, after a warm-up. Beside it, the same proposer in this process, on the same
sequences, gives the lookup alone. Each case gets a fresh drafter and proposer (a suffix drafter's global tree
grows with every sequence it served). Medians. Random tokens: a lookup finds short matches, as on new text; the
in-process lookup is handed lists, as the in-process engine hands them, the drafter service its token views.

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


async def timed_calls(proposer, rows: int, context: int) -> float:
    """Median seconds of one propose() over `rows` sequences that start at `context` tokens and grow by one a call."""
    rng = random.Random(1)
    seqs = sequences(rows, context)
    seconds = []
    for step in range(STEPS):
        inputs = [DraftInput(seq_id, tokens, K) for seq_id, tokens in seqs.items()]
        started = time.perf_counter()
        await proposer.propose(inputs)
        if step >= WARM_UP:
            seconds.append(time.perf_counter() - started)
        for tokens in seqs.values():
            tokens.append(rng.randrange(VOCAB))
    return statistics.median(seconds)


async def over_the_link(address: str, rows: int, context: int) -> float:
    proposer = await RemoteProposer.connect(RemoteProposerConfig(target=address, vocab_size=VOCAB))
    try:
        return await timed_calls(proposer, rows, context)
    finally:
        await proposer.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.drafter_link", description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="ngram", help="a drafter method that needs no model (ngram, suffix)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 2000])
    args = parser.parse_args(argv)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    config = SpeculativeConfig(method=args.method, num_speculative_tokens=K)
    argv_tail = ["--method", args.method, "--num-speculative-tokens", str(K)]
    for context in args.contexts:
        for rows in args.rows:
            local = asyncio.run(timed_calls(build_proposer(config), rows, context))
            with drafter_process(argv_tail, lambda message: None) as (address, _):
                linked = asyncio.run(over_the_link(address, rows, context))
            print(f"{args.method}, {rows:>3} rows of {context:>5} tokens: {linked * 1e3:6.2f} ms a call over the "
                  f"link, {local * 1e3:6.2f} ms the lookup alone in process", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
