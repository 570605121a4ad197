"""What a verify step costs against a plain decode step, measured on the bench's own runner and thread.

Why it is in the report: drafting pays only if verifying K + 1 positions costs little more than one position
(on CPU the weights are read once for all positions). The issue's bar is 9 positions <= 1.5x one position; the
figure depends on the machine and the kernels chosen, so every report carries its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import Executor

from services.modeling.compute_placement import PROBE_CONTEXT_TOKENS, decode_probe
from services.modeling.runner import ModelRunner


def median_forward_s(
    runner: ModelRunner, num_tokens: int, run_on: Callable[[Callable[[], float]], float], repeats: int = 15
) -> float:
    forward, release = decode_probe(runner, num_tokens)

    def timed() -> float:
        started = time.perf_counter()
        forward()
        return time.perf_counter() - started

    try:
        for _ in range(3):
            run_on(timed)
        return statistics.median(run_on(timed) for _ in range(repeats))
    finally:
        release()


def describe_verify_cost(runner: ModelRunner, placement: str, worker: Executor, positions: int = 9) -> str:
    """One header line: the forward time of 1 and of `positions` positions at the probe's context length, and
    their ratio, timed on the thread the engine's forwards run on."""
    run_on = (lambda fn: fn()) if placement == "main" else (lambda fn: worker.submit(fn).result())
    one = median_forward_s(runner, 1, run_on)
    many = median_forward_s(runner, positions, run_on)
    return (f"1 position {one * 1e3:.1f} ms, {positions} positions {many * 1e3:.1f} ms ({many / one:.2f}x) "
            f"after {PROBE_CONTEXT_TOKENS} tokens of context")
