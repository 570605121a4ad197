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
"""

from __future__ import annotations

import torch

ROW_BY_ROW_FROM = 256  # mean positions read per row from which a CPU forward reads row by row


class AttentionPaths:
    def __init__(self, row_by_row_from: float) -> None:
        """row_by_row_from: the mean span (positions read per row) from which rows are read one by one."""
        self.row_by_row_from = row_by_row_from

    @classmethod
    def for_device(cls, device: torch.device) -> AttentionPaths:
        return cls(ROW_BY_ROW_FROM if device.type == "cpu" else float("inf"))

    def row_by_row(self, rows: int, mean_span: float) -> bool:
        """A single row is always a view; a batch reads row by row from row_by_row_from on."""
        return rows == 1 or mean_span >= self.row_by_row_from

    def describe(self) -> str:
        if self.row_by_row_from == float("inf"):
            return "one padded gather per batch (a single row: a view)"
        return f"one padded gather per batch below {self.row_by_row_from:g} positions a row, row-by-row views from there"
