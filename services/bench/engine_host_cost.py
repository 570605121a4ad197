"""What the engine's own host work costs a step, with the model taken out: the ceiling a fast accelerator meets.

Run: `python -m services.bench.engine_host_cost [--rows 1 8 64] [--tokens 256]`. On an H100 SmolLM2's captured
step takes about 5 ms, so what the engine does around it (planning, drafting, sampling on the host, committing,
the asyncio loop) decides the throughput at high concurrency. Here the engine drives a ScriptedRunner: a "model"
that answers instantly with logits that continue a fixed token script, so that the time measured is the engine's
own, and n-gram drafts from the context are accepted. Printed per row count, without speculation and with ngram
(K = 4): tokens/s, forwards, and host ms per forward.

The vocabulary is small by default (--vocab 512): on a CPU the sampling and verification over the vocabulary run
as host math, where an accelerator runs them as kernels and the host pays only to launch each one. With a small
vocabulary each tensor operation costs about its dispatch, as a launch does, so what is measured is the host's
part of an accelerator's step. `--vocab 49152` (SmolLM2's) shows the CPU's own case instead.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Hashable, Sequence

import torch

from services.bench.hardware import describe_hardware
from services.common.speculative_config import SpeculativeConfig
from services.inprocess import local_proposers
from services.modeling.runner import ForwardOutput, KVUsage, RowInput
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams

SCRIPT_PERIOD = 40
CONFIDENT = 30.0  # the scripted token's logit; every other token's is 0


def script_token(position: int, vocab: int) -> int:
    """The token the scripted model puts at `position`: a period of SCRIPT_PERIOD distinct tokens."""
    return (position % SCRIPT_PERIOD * 7919 + 13) % vocab


class ScriptedRunner:
    """A ModelRunner whose forward costs next to nothing: at every position it predicts the script's next token."""

    supports_trees = False
    device = torch.device("cpu")

    def __init__(self, max_num_seqs: int, vocab_size: int, max_model_len: int = 8192) -> None:
        self.vocab_size = vocab_size
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
                logits[b, i, script_token(start + fed - row.num_logits + i + 1, self.vocab_size)] = CONFIDENT
            self._lengths[row.seq_id] = start + fed
        self.forward_s += time.perf_counter() - started
        return ForwardOutput(logits=logits, hidden_states=torch.zeros(len(rows), max(len(r.token_ids) for r in rows), 1))


async def run_case(rows: int, speculate: bool, tokens: int, vocab: int, adaptive: bool = True) -> dict[str, float]:
    """`rows` greedy requests of `tokens` each, all at once, after one unmeasured round. adaptive: the engine's
    default adaptive speculation, whose K follows the step costs it measures (so the number of forwards depends on
    the machine and its load); False: K = 4 at every step."""
    runner = ScriptedRunner(rows, vocab)
    engine = Engine(runner, EngineConfig(adaptive_speculation=adaptive),
                    local_proposers(SpeculativeConfig(method="ngram", num_speculative_tokens=4)))
    speculation = SpeculationParams("ngram", 4) if speculate else SpeculationParams()

    async def one(name: str, offset: int) -> list[int]:
        prompt = tuple(script_token(p, vocab) for p in range(2 * SCRIPT_PERIOD + offset))
        request = GenerationRequest(name, prompt, SamplingParams(max_tokens=tokens, temperature=0.0), speculation)
        out: list[int] = []
        async for output in engine.generate(request):
            out += output.token_ids
        return out

    async with engine:
        await asyncio.gather(*(one(f"warm-{i}", i) for i in range(rows)))
        forwards, forward_s, started = runner.forwards, runner.forward_s, time.perf_counter()
        outputs = await asyncio.gather(*(one(f"run-{i}", i) for i in range(rows)))
        seconds = time.perf_counter() - started
    steps = runner.forwards - forwards
    return {"tokens": sum(map(len, outputs)), "seconds": seconds, "forwards": steps,
            "host_ms_per_forward": 1000 * (seconds - (runner.forward_s - forward_s)) / max(steps, 1),
            "follows_script": all(out == [script_token(2 * SCRIPT_PERIOD + i + j, vocab) for j in range(len(out))]
                                  for i, out in enumerate(outputs))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.engine_host_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args(argv)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    for rows in args.rows:
        for speculate in (False, True):
            figures = asyncio.run(run_case(rows, speculate, args.tokens, args.vocab))
            print(f"{rows:>3} rows, {'ngram K=4' if speculate else 'no speculation'}: "
                  f"{figures['tokens'] / figures['seconds']:7.0f} tok/s, {figures['forwards']} forwards, "
                  f"{figures['host_ms_per_forward']:.2f} ms of host work a forward"
                  + ("" if figures["follows_script"] else " (OUTPUT DIFFERS FROM THE SCRIPT)"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
