"""Two ways to read a batch's K/V from the paged pool, and which one a forward takes.

- Padded batch: gather every row's positions into one [kv_heads, rows, span, head_dim] buffer, one pair of
  matmuls for the batch. The gather copies every position read: cheap for short spans, dominant for long ones.
- Row by row: each row's blocks, which the pool keeps in order, read as a view of the pool and attended on their
  own, unpadded; one pair of matmuls per row, so more small operations per layer.

Measured on a 2-core AMD EPYC with SmolLM2-135M (decode steps of one token a row, ms; `make bench-prefix` prints
these rows from services/bench/kv_step_speed.py): at 150 positions per row the gather wins (8 rows: 106 vs 117,
16 rows: 137 vs 183); at 1,000 row by row wins (8 rows: 193 vs 197, 16 rows: 267 vs 341). A start-up probe on
synthetic tensors was tried and dropped: the gather's cost swung 3-10x with whether its buffer's pages were fresh,
so it chose differently from run to run. Gathering whole blocks instead of positions was tried too and was no
faster (the span rounds up to whole blocks). An accelerator gathers at memory speed and keeps the padded batch (a
paged attention kernel replaces both there: issue 29).

So on CPU the threshold is only where each batch shape starts: a shape (rows, span and tokens a row, each rounded
to a power of two) of at least LEARN_FROM positions a row is served by both paths a few times each, on the real
steps, and then by the one whose steps took less time (the threshold's unless the other is MARGIN faster: a
near tie changes nothing); every REVISIT-th step of a shape tries the other path once more, so a choice follows
the machine's drift. The two paths compute the same attention (up to the order of float additions over the
padding), so the choice changes speed, not what is computed. On a 2-core Intel Xeon (AVX-512, AMX) the gather beat the views at 1,000 positions too (8 rows:
124 vs 136 ms, 16 rows: 167 vs 209), where the AMD EPYC's threshold would have read row by row.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

ROW_BY_ROW_FROM = 256  # mean positions read per row from which a CPU forward starts reading row by row
LEARN_FROM = 256  # mean positions a row from which a batch shape's path is learned (below, the gather won on both CPUs)
MIN_SAMPLES = 3  # steps each path serves a shape before the faster one is chosen
KEPT_SAMPLES = 7  # the latest timings of a shape and path whose median stands for it
REVISIT = 32  # every this many steps of a shape, the other path serves one
MARGIN = 0.05  # the threshold's path stays unless the other is this much faster (no flip-flop on a near tie)

Shape = tuple[int, int, int]  # (rows, mean span, tokens a row), each as its power-of-two bucket


class AttentionPaths:
    def __init__(self, row_by_row_from: float, learn: bool = False) -> None:
        """row_by_row_from: the mean span (positions read per row) from which rows are read one by one. learn: each
        batch shape's path is then chosen by the timings observe() reports (module docstring)."""
        self.row_by_row_from = row_by_row_from
        self.learn = learn
        self._samples: dict[tuple[Shape, bool], deque[float]] = {}
        self._uses: dict[Shape, int] = {}

    @classmethod
    def for_device(cls, device: torch.device) -> AttentionPaths:
        if device.type == "cpu":
            return cls(ROW_BY_ROW_FROM, learn=True)
        return cls(float("inf"))

    @staticmethod
    def shape(rows: int, mean_span: float, width: int) -> Shape:
        return rows.bit_length(), int(mean_span).bit_length(), width.bit_length()

    def _learns(self, rows: int, mean_span: float) -> bool:
        return self.learn and rows > 1 and mean_span >= LEARN_FROM

    def row_by_row(self, rows: int, mean_span: float, width: int = 1) -> bool:
        """A single row is always a view; a batch reads row by row from row_by_row_from on, or as learned."""
        static = rows == 1 or mean_span >= self.row_by_row_from
        if not self._learns(rows, mean_span):
            return static
        shape = self.shape(rows, mean_span, width)
        uses = self._uses[shape] = self._uses.get(shape, 0) + 1
        counts = {path: len(self._samples.get((shape, path), ())) for path in (True, False)}
        if min(counts.values()) < MIN_SAMPLES:  # explore: the path with fewer timings (the threshold's on a tie)
            return static if counts[True] == counts[False] else counts[True] < counts[False]
        medians = {path: statistics.median(self._samples[(shape, path)]) for path in (True, False)}
        best = static if medians[not static] > (1 - MARGIN) * medians[static] else not static
        return (not best) if uses % REVISIT == 0 else best

    def observe(self, rows: int, mean_span: float, width: int, row_by_row: bool, seconds: float) -> None:
        """A forward of this shape took `seconds` on the path it was given."""
        if self._learns(rows, mean_span):
            key = (self.shape(rows, mean_span, width), row_by_row)
            self._samples.setdefault(key, deque(maxlen=KEPT_SAMPLES)).append(seconds)

    def describe(self) -> str:
        if self.row_by_row_from == float("inf"):
            return "one padded gather per batch (a single row: a view)"
        text = (f"one padded gather per batch below {self.row_by_row_from:g} positions a row, row-by-row views "
                "from there")
        return text + (f"; from {LEARN_FROM} positions a row, each batch shape's faster path learned on its steps"
                       if self.learn else "")
