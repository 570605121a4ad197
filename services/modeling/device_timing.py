"""Device time of a small piece of tensor work on CUDA, without its launch cost: the calls are captured into one
CUDA graph and the graph replayed, as the engine's steps are (step_graphs.py). Timing eager calls would time the
host launching them instead, since each of these pieces runs for microseconds."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[[], object], repeats: int = 50, replays: int = 5) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph of `repeats` calls (CUDA events around `replays`
    replays, after one untimed replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: a first call may allocate or pick a kernel
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * repeats)
