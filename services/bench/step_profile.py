"""Where one engine step's time goes without speculation: the runner's forward, the step's other tensor work
(sampling batch, verification, the host transfer) and everything on the asyncio side (scheduling, the hop to
the compute thread, bookkeeping, emitting outputs).

Run: `python -m services.bench.step_profile --model smollm2-135m-instruct` (one greedy request of --max-tokens
tokens, --repeats times; prints per-step medians). The timers wrap the engine's own calls, so the figures are
what the served engine spends, on whichever thread it runs its forwards.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.modeling.loading import load_model
from services.modeling.registry import DEFAULT_MODEL
from services.modeling.runner_factory import create_runner
from services.verifier import step_execution
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams

PROMPT = "Write a Python function that sorts a list of numbers with quicksort, with a docstring and tests."


@dataclass
class Timers:
    seconds: dict[str, float] = field(default_factory=dict)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

        return timed


async def profile_once(engine: Engine, timers: Timers, prompt: Sequence[int], max_tokens: int, label: str) -> dict:
    """Per-step milliseconds of one request's decode steps (its prefill step excluded)."""
    request = GenerationRequest(label, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True))
    first_token_at, tokens = None, 0
    async for output in engine.generate(request):
        if first_token_at is None:
            first_token_at = time.perf_counter()
            timers.seconds.clear()
        tokens += len(output.token_ids)
    steps = tokens - 1
    total = (time.perf_counter() - first_token_at) / steps
    forward = timers.seconds.get("forward", 0.0) / steps
    execute = timers.seconds.get("execute", 0.0) / steps
    return {"step": total * 1e3, "forward": forward * 1e3, "other tensor work": (execute - forward) * 1e3,
            "loop side": (total - execute) * 1e3}


async def profile(model_spec: str, max_tokens: int, repeats: int) -> list[dict]:
    loaded = load_model(model_spec)
    runner = create_runner(loaded.model, max_num_seqs=1, max_model_len=1024)
    return await profile_runner(runner, loaded.tokenizer(PROMPT)["input_ids"] * 4, max_tokens, repeats)


async def profile_runner(runner, prompt: Sequence[int], max_tokens: int, repeats: int) -> list[dict]:
    """`repeats` greedy requests of `max_tokens` on an engine around `runner` (its forward gets wrapped)."""
    timers = Timers()
    runner.forward = timers.wrap("forward", runner.forward)
    original = step_execution.execute
    step_execution.execute = timers.wrap("execute", original)
    try:
        async with Engine(runner, EngineConfig(log_stats_interval_s=0)) as engine:
            return [await profile_once(engine, timers, prompt, max_tokens, f"profile-{i}") for i in range(repeats)]
    finally:
        step_execution.execute = original


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.step_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs = asyncio.run(profile(args.model, args.max_tokens, args.repeats))
    for name in runs[0]:
        values = [run[name] for run in runs]
        print(f"{name:>18}: {statistics.median(values):6.2f} ms per step (runs: {', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
