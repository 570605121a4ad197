"""What the engine's own host work costs a step, with the model taken out: the ceiling a fast accelerator meets.

Run: `python -m services.bench.engine_host_cost [--rows 1 8 64] [--tokens 256] [--text novel] [--link]`. On an H100
SmolLM2's captured step takes about 5 ms, so what the engine does around it (planning, drafting, sampling on the
host, committing, the asyncio loop) decides the throughput at high concurrency. Here the engine drives a
ScriptedRunner: a "model" that answers instantly with logits that continue a fixed token script, so that the time
measured is the engine's own, and n-gram drafts from the context are accepted. Printed per row count, without
speculation and with ngram (K = 4): tokens/s, forwards, and host ms per forward.

`--text novel` scripts text that never repeats, so the n-gram drafter never has a draft (new chat text, where it
mostly has none): what speculation costs where it cannot pay, which adaptive speculation should keep near nothing.
`--link` reaches the drafter as deployed, a `specserve drafter` process over gRPC, so each drafting call costs a
round trip (in process, the lookup alone).

The vocabulary is small by default (--vocab 512): on a CPU the sampling and verification over the vocabulary run
as host math, where an accelerator runs them as kernels and the host pays only to launch each one. With a small
vocabulary each tensor operation costs about its dispatch, as a launch does, so what is measured is the host's
part of an accelerator's step. `--vocab 49152` (SmolLM2's) shows the CPU's own case instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Hashable, Sequence

import torch

from services.bench.drafter_process import drafter_process
from services.bench.hardware import describe_hardware
from services.common.speculative_config import SpeculativeConfig
from services.inprocess import local_proposers
from services.modeling.runner import ForwardOutput, KVUsage, RowInput
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams

SCRIPT_PERIOD = 40
CONFIDENT = 30.0  # the scripted token's logit; every other token's is 0


def script_token(position: int, vocab: int, period: int = SCRIPT_PERIOD) -> int:
    """The token the scripted model puts at `position`: a period of `period` distinct tokens (at most `vocab`)."""
    return (position % period * 7919 + 13) % vocab


class ScriptedRunner:
    """A ModelRunner whose forward costs next to nothing: at every position it predicts the script's next token."""

    supports_trees = False
    device = torch.device("cpu")

    def __init__(self, max_num_seqs: int, vocab_size: int, max_model_len: int = 8192, period: int = SCRIPT_PERIOD
                 ) -> None:
        self.vocab_size = vocab_size
        self.period = period
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.forwards = 0
        self.forward_s = 0.0
        self._lengths: dict[Hashable, int] = {}

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        self._lengths[seq_id] = 0
        return 0

    def remove_sequence(self, seq_id: Hashable) -> None:
        self._lengths.pop(seq_id, None)

    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self._lengths)

    def length(self, seq_id: Hashable) -> int:
        return self._lengths[seq_id]

    def truncate(self, seq_id: Hashable, length: int) -> None:
        self._lengths[seq_id] = length

    def kv_blocks_needed(self, seq_id: Hashable | None, length: int) -> int:
        return 0

    def kv_blocks_available(self) -> int:
        return 1 << 30

    def reserve(self, seq_id: Hashable, length: int) -> None:
        pass

    def capture_graphs(self, max_width: int, tails: Sequence = ()) -> int:
        return 0

    @property
    def kv_usage(self) -> KVUsage:
        return KVUsage(1, 0, 0, 16, None)

    def forward(self, rows: Sequence[RowInput]) -> ForwardOutput:
        started = time.perf_counter()
        self.forwards += 1
        logits = torch.zeros(len(rows), max(row.num_logits for row in rows), self.vocab_size)
        for b, row in enumerate(rows):
            start, fed = self._lengths[row.seq_id], len(row.token_ids)
            for i in range(row.num_logits):  # logits i belong to fed position fed - num_logits + i
                position = start + fed - row.num_logits + i + 1
                logits[b, i, script_token(position, self.vocab_size, self.period)] = CONFIDENT
            self._lengths[row.seq_id] = start + fed
        self.forward_s += time.perf_counter() - started
        return ForwardOutput(logits=logits, hidden_states=torch.zeros(len(rows), max(len(r.token_ids) for r in rows), 1))


async def run_case(rows: int, speculate: bool, tokens: int, vocab: int, adaptive: bool = True, novel: bool = False,
                   drafter: str | None = None) -> dict[str, float]:
    """`rows` greedy requests of `tokens` each, all at once, after one unmeasured round. adaptive: the engine's
    default adaptive speculation, whose K follows the step costs it measures (so the number of forwards depends on
    the machine and its load); False: K = 4 at every step. novel: text that never repeats within the vocabulary
    (each request's prompt and output must fit in it). drafter: the address of an ngram drafter process to reach
    over gRPC; None: the lookup in process."""
    period = vocab if novel else SCRIPT_PERIOD
    runner = ScriptedRunner(rows, vocab, period=period)
    if drafter is None:
        proposers = local_proposers(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    else:
        proposers = {"ngram": RemoteProposer(RemoteProposerConfig(drafter, vocab), method="ngram")}
    calls = CountedCalls(proposers["ngram"])
    proposers["ngram"].propose = calls
    engine = Engine(runner, EngineConfig(adaptive_speculation=adaptive), proposers)
    speculation = SpeculationParams("ngram", 4) if speculate else SpeculationParams()
    prompt_length = 2 * SCRIPT_PERIOD

    async def one(name: str, offset: int) -> list[int]:
        prompt = tuple(script_token(p, vocab, period) for p in range(prompt_length + offset))
        request = GenerationRequest(name, prompt, SamplingParams(max_tokens=tokens, temperature=0.0), speculation)
        out: list[int] = []
        async for output in engine.generate(request):
            out += output.token_ids
        return out

    async with engine:
        await asyncio.gather(*(one(f"warm-{i}", i) for i in range(rows)))
        forwards, forward_s, started, asked = runner.forwards, runner.forward_s, time.perf_counter(), calls.count
        outputs = await asyncio.gather(*(one(f"run-{i}", i) for i in range(rows)))
        seconds = time.perf_counter() - started
    if drafter is not None:
        await proposers["ngram"].close()
    steps = runner.forwards - forwards
    return {"tokens": sum(map(len, outputs)), "seconds": seconds, "forwards": steps,
            "drafter_calls": calls.count - asked,
            "host_ms_per_forward": 1000 * (seconds - (runner.forward_s - forward_s)) / max(steps, 1),
            "follows_script": all(out == [script_token(prompt_length + i + j, vocab, period) for j in range(len(out))]
                                  for i, out in enumerate(outputs))}


class CountedCalls:
    """A proposer's propose(), counting the calls the engine makes (set as the proposer's own `propose`, so that
    everything else the engine reads of the proposer is the proposer's)."""

    def __init__(self, proposer) -> None:
        self.propose = proposer.propose
        self.count = 0

    async def __call__(self, inputs):
        self.count += 1
        return await self.propose(inputs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.engine_host_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--text", choices=("repeating", "novel"), default="repeating")
    parser.add_argument("--link", action="store_true", help="the ngram drafter as a process, over gRPC")
    args = parser.parse_args(argv)
    novel = args.text == "novel"
    if novel and args.vocab < 2 * SCRIPT_PERIOD + max(args.rows) + args.tokens:
        parser.error("--text novel needs a vocabulary larger than a request's prompt and output (raise --vocab)")
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    with contextlib.ExitStack() as stack:
        drafter = None
        if args.link:
            drafter, _ = stack.enter_context(drafter_process(["--method", "ngram", "--num-speculative-tokens", "4"],
                                                             lambda message: print(message, flush=True)))
        for rows in args.rows:
            rates = {}
            for speculate in (False, True):
                figures = asyncio.run(run_case(rows, speculate, args.tokens, args.vocab, novel=novel, drafter=drafter))
                rates[speculate] = figures["tokens"] / figures["seconds"]
                print(f"{rows:>3} rows, {args.text} text, {'ngram K=4' if speculate else 'no speculation'}"
                      f"{' over gRPC' if speculate and args.link else ''}: {rates[speculate]:7.0f} tok/s, "
                      f"{figures['forwards']} forwards, {figures['drafter_calls']} drafter calls, "
                      f"{figures['host_ms_per_forward']:.2f} ms of host work a forward"
                      + ("" if figures["follows_script"] else " (OUTPUT DIFFERS FROM THE SCRIPT)"), flush=True)
            print(f"{rows:>3} rows, {args.text} text: ngram / none {rates[True] / rates[False]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
