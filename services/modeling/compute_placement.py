"""Which thread runs the engine's forwards: measured at start-up on the actual model, machine and torch build.

Why measure: torch's CPU intra-op pool belongs to the calling thread, and whether a worker thread pays for it
depends on the machine (a 2-core Intel Xeon with AMX: 49-52 ms per forward on a worker thread, 34.5 ms on the
main thread; a 2-core AMD EPYC: the same on both). The probe times one-token decode forwards at a few hundred
tokens of context, alternating the two threads so a noisy spell hits both, and picks the main thread only when
it is clearly faster: keeping the asyncio loop on the main thread is the simpler arrangement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Literal

import torch

from services.modeling.runner import ModelRunner, RowInput

logger = logging.getLogger(__name__)

ComputeThread = Literal["auto", "main", "worker"]
MAIN_THREAD_MARGIN = 0.05  # the main thread must be this much faster to move the asyncio loop off it
PROBE_CONTEXT_TOKENS = 256
PROBE_SEQUENCE_ID = "specserve-placement-probe"


@dataclass(frozen=True)
class PlacementTiming:
    main_thread_s: float  # fastest seconds per probe forward (contention only adds time)
    worker_thread_s: float

    @property
    def best(self) -> Literal["main", "worker"]:
        return "main" if self.main_thread_s < (1 - MAIN_THREAD_MARGIN) * self.worker_thread_s else "worker"

    def describe(self) -> str:
        return (f"one-token forward {self.main_thread_s * 1e3:.1f} ms on the main thread, "
                f"{self.worker_thread_s * 1e3:.1f} ms on a worker thread")


def time_on_both_threads(
    forward: Callable[[], None],
    worker: Executor,
    repeats: int = 12,
    warmup: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> PlacementTiming:
    """Fastest time of `forward` on the calling thread and on `worker`, alternated; warm-up runs on both first
    (each thread's pool starts on its first parallel region). The minimum, because other work on a shared
    machine only adds time, while a slower thread pool is slower on every call."""

    def timed() -> float:
        started = clock()
        forward()
        return clock() - started

    for _ in range(warmup):
        timed()
        worker.submit(timed).result()
    main, other = [], []
    for _ in range(repeats):
        main.append(timed())
        other.append(worker.submit(timed).result())
    return PlacementTiming(min(main), min(other))


def decode_probe(runner: ModelRunner, num_tokens: int = 1) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward, release): `forward` runs `num_tokens` positions with their logits (one decode token, or a
    verify step of K + 1 = num_tokens) after a prompt of up to PROBE_CONTEXT_TOKENS in a slot of the runner's
    own, and rolls it back; `release` frees the slot. Needs one free slot."""
    context = max(1, min(PROBE_CONTEXT_TOKENS, runner.max_model_len - 1 - num_tokens))
    vocab = runner.vocab_size
    runner.add_sequence(PROBE_SEQUENCE_ID)
    runner.forward([RowInput(PROBE_SEQUENCE_ID, [(7 * i + 1) % vocab for i in range(context)], 1)])
    synchronize = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def forward() -> None:
        runner.forward([RowInput(PROBE_SEQUENCE_ID, [(3 + i) % vocab for i in range(num_tokens)], num_tokens)])
        synchronize()
        runner.truncate(PROBE_SEQUENCE_ID, context)

    return forward, lambda: runner.remove_sequence(PROBE_SEQUENCE_ID)


def choose_compute_thread(
    requested: ComputeThread, runner: ModelRunner, worker: Executor
) -> tuple[Literal["main", "worker"], PlacementTiming | None]:
    """`requested` unless "auto"; for "auto", the faster thread by `time_on_both_threads` (logged either way).
    Call from the main thread before serving; `worker` must be the executor the engine will use."""
    if requested != "auto":
        logger.info("model forwards run on the %s thread (--compute-thread %s)", requested, requested)
        return requested, None
    forward, release = decode_probe(runner)
    try:
        timing = time_on_both_threads(forward, worker)
    finally:
        release()
    logger.info("model forwards run on the %s thread: %s", timing.best, timing.describe())
    return timing.best, timing
