"""On CPU each batch shape's attention path is learned from its own steps' timings (attention_paths.py)."""

from __future__ import annotations

import torch

from services.modeling.attention_paths import LEARN_FROM, MIN_SAMPLES, REVISIT, ROW_BY_ROW_FROM, AttentionPaths
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.runner import RowInput
from tests.tiny_models import tiny_llama


def serve_steps(paths: AttentionPaths, steps: int, seconds: dict[bool, float], rows=8, span=1000, width=1):
    """`steps` decisions for one shape, each path taking its given time; returns the paths chosen."""
    chosen = []
    for _ in range(steps):
        row_by_row = paths.row_by_row(rows, span, width)
        paths.observe(rows, span, width, row_by_row, seconds[row_by_row])
        chosen.append(row_by_row)
    return chosen


def test_a_shape_tries_both_paths_then_keeps_the_faster_and_revisits_the_other():
    paths = AttentionPaths(ROW_BY_ROW_FROM, learn=True)
    chosen = serve_steps(paths, 2 * MIN_SAMPLES, {True: 0.136, False: 0.124})  # the Intel's 8 x 1,000 timings
    assert chosen.count(True) == chosen.count(False) == MIN_SAMPLES and chosen[0] is True  # the threshold's first
    chosen = serve_steps(paths, 3 * REVISIT, {True: 0.136, False: 0.124})
    assert chosen.count(True) == 3 and chosen.count(False) == 3 * REVISIT - 3  # the gather, the views revisited
    chosen = serve_steps(paths, 10 * REVISIT, {True: 0.100, False: 0.124})  # the machine changed: views now win
    assert chosen[-2 * REVISIT :].count(False) == 2  # once the new timings outweigh the old: views, gather revisited


def test_short_spans_single_rows_and_accelerators_keep_their_fixed_path():
    paths = AttentionPaths(ROW_BY_ROW_FROM, learn=True)
    assert serve_steps(paths, 20, {True: 0.001, False: 1.0}, span=LEARN_FROM - 1) == [False] * 20
    assert serve_steps(paths, 20, {True: 1.0, False: 0.001}, rows=1) == [True] * 20
    gpu = AttentionPaths.for_device(torch.device("meta"))
    assert not gpu.learn and not gpu.row_by_row(8, 5000) and gpu.row_by_row(1, 5000)
    assert AttentionPaths.for_device(torch.device("cpu")).learn
    assert not AttentionPaths(0).learn  # an explicit path (the step-speed bench's) stays fixed


def test_a_cpu_runner_times_its_batched_steps_on_both_paths():
    runner = LlamaFamilyRunner(tiny_llama(), max_num_seqs=4, max_model_len=512, pack_weights=False,
                               kv_cache=KVCacheConfig(memory_bytes=8 << 20, block_size=8))
    assert runner.attention_paths.learn
    for seq in "ab":
        runner.add_sequence(seq)
        runner.forward([RowInput(seq, [3 + i % 50 for i in range(300)], 1)])
    for step in range(2 * MIN_SAMPLES):
        runner.forward([RowInput(seq, [5], 1) for seq in "ab"])
    shape = AttentionPaths.shape(2, 301, 1)
    timed = {path: len(runner.attention_paths._samples.get((shape, path), ())) for path in (True, False)}
    assert timed == {True: MIN_SAMPLES, False: MIN_SAMPLES}, timed


def test_a_near_tie_keeps_the_thresholds_path():
    paths = AttentionPaths(ROW_BY_ROW_FROM, learn=True)
    chosen = serve_steps(paths, 3 * REVISIT, {True: 0.130, False: 0.126})  # 3% apart
    assert chosen[2 * MIN_SAMPLES :].count(False) == 3  # 1,000 positions: the threshold reads row by row; revisits
