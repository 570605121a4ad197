"""specserve's engine under the benchmark: one request at a time, or a batch of concurrent requests.

Requests go through the public Engine API (add a request, await its stream) with the engine's own background
loop, exactly as the verifier service drives it, so the timings include the scheduler and asyncio overhead.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from services.bench.report import Generation
from services.common.drafter_methods import build_proposer
from services.common.speculative_config import SpeculativeConfig
from services.modeling.runner import ModelRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams


def build_engine(
    runner: ModelRunner, eos_token_ids: Sequence[int], compute: Executor, adaptive_speculation: bool = True
) -> Engine:
    """One engine per round on the bench's one runner (slots for the concurrent batch), its forwards on `compute`
    (the thread the start-up measurement chose); proposers are set per measurement (fresh_proposer)."""
    config = EngineConfig(
        max_num_batched_tokens=512, log_stats_interval_s=0, adaptive_speculation=adaptive_speculation
    )
    return Engine(runner, config, {}, eos_token_ids, compute)


def speculation(method: str | None, k: int) -> SpeculationParams:
    """No method (or K = 0) means speculation off."""
    return SpeculationParams(method=method, num_speculative_tokens=k) if method and k > 0 else SpeculationParams()


def fresh_proposer(engine: Engine, config: SpeculativeConfig) -> None:
    """A new proposer for `config.method` before each measurement: a stateful one (suffix keeps every answer it
    saw) would otherwise draft one row's requests from another row's identical answers."""
    engine.proposers[config.method] = build_proposer(config)


class RequestIds:
    """Unique request ids across the whole run (the engine refuses a reused id while it is live)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next(self, label: str) -> str:
        return f"{label}-{next(self._counter)}"


async def generate_one(
    engine: Engine, request_id: str, prompt: Sequence[int], max_tokens: int, method: str | None, k: int,
    temperature: float = 0.0, seed: int | None = None,
) -> Generation:
    """Time one request from submission to its last token (greedy unless `temperature`)."""
    request = GenerationRequest(
        request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
        speculation(method, k)
    )
    tokens: list[int] = []
    steps = 0
    started = time.perf_counter()
    last = None
    async for output in engine.generate(request):
        tokens += output.token_ids
        steps += bool(output.token_ids)
        last = output
    seconds = time.perf_counter() - started
    spec = last.spec if last is not None else None
    return Generation(
        tuple(tokens), seconds, steps, spec.num_drafts if spec else 0, spec.num_accepted_tokens if spec else 0
    )


async def run_concurrent(
    engine: Engine,
    ids: RequestIds,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    method: str | None,
    k: int,
    concurrency: int,
    progress: Callable[[str], None],
) -> tuple[tuple[Generation, ...], float]:
    """`concurrency` requests submitted at once (prompts cycled); returns them and the batch's wall time."""
    batch = list(itertools.islice(itertools.cycle(prompts), concurrency))
    started = time.perf_counter()
    results = await asyncio.gather(
        *(generate_one(engine, ids.next("batch"), prompt, max_tokens, method, k) for prompt in batch)
    )
    seconds = time.perf_counter() - started
    total = sum(len(r.tokens) for r in results)
    progress(f"  {concurrency} requests: {total} tokens in {seconds:.1f} s ({total / seconds:.1f} tok/s)")
    return tuple(results), seconds
