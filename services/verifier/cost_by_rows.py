"""A cost that grows with a step's decoding rows: a step's bookkeeping outside its forward (planning, committing,
the loop), and what a step that verifies drafts spends on it beyond a plain step's, each a part per step (the
second plan, the verification's launches) and a part per row (drafts cut and checked, tokens committed).

Learned per bucket of rows (1, 2-3, 4-7, ...: powers of two), each bucket an exponential moving average of the
rows seen in it and of their cost, and predicted by a least-squares line through the buckets (neither its fixed
part nor its slope below zero; the one figure while one bucket is known). Why not one moving average for every
row count: a figure learned at 64 rows, charged to one request after the burst (whose steps rarely verify drafts,
so it is not measured again), priced its drafts at 1.3 ms a step where they cost 0.1. Why not a cost per row
alone: the part per step, learned while a batch starts with a row or two, then counted eight times over at 8.

A bucket seen for the first time starts from the line's figure for it (0 before anything is known) and moves
toward what it sees by `smoothing` a step, as the one figure did before."""

from __future__ import annotations

from services.verifier.draft_cost import nonnegative_line


class CostByRows:
    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self._buckets: dict[int, tuple[float, float]] = {}  # rows.bit_length() -> (rows seen, seconds)
        self._line: tuple[float, float] | None = None  # (fixed, per row) through the buckets; None: not fitted

    def observe(self, rows: int, seconds: float) -> None:
        bucket = max(1, rows).bit_length()
        seen = self._buckets.get(bucket)
        if seen is None:
            seen = (float(rows), self.predict(rows) or 0.0)
        mean_rows, mean_s = seen
        self._buckets[bucket] = (mean_rows + self.smoothing * (rows - mean_rows),
                                 mean_s + self.smoothing * (seconds - mean_s))
        self._line = None

    def predict(self, rows: int) -> float | None:
        """Expected seconds at `rows` (None before any observation)."""
        if not self._buckets:
            return None
        if self._line is None:
            if len(self._buckets) == 1:
                (_, seconds), = self._buckets.values()
                self._line = (seconds, 0.0)
            else:
                self._line = nonnegative_line(dict(self._buckets.values()))
        fixed, per_row = self._line
        return fixed + per_row * rows
