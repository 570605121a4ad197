"""The rows' figures a step's first plan reads, kept from one step to the next while nothing they depend on changed:
each row's survival by draft position, how often its proposer has a draft at all, and their weighted sums by
column (what verifying each column is worth over the batch).

Read a row at a time, they were most of the plan's cost under load. At 64 decoding rows the plan took about 0.45 ms
a step on a 2-core EPYC, survivals, draft rates and column sums about half of it (engine_host_cost's chat text on
a simulated H200 step, timed inside the engine, where the rows' objects are cold in the CPU's caches: three to four
times what the same loops take timed warm), and most steps under load verify nothing and ask nothing, so nothing
they read had changed. Kept, the plan takes about 0.22 ms there (with cheaper cost predictions, step_cost.py).

A row's figures change only when its acceptance is observed (a verified draft, which also moves its method's
prior, so every row of that method), when its proposer is asked (its draft rate, and whether it was ever asked: an
ask opens it on the drafter), when its re-probe schedule moves, or when its cap changes; and the batch's when its
rows change. The planner counts the first three (`changed`); the figures are computed again when that count, the
rows (compared by identity) or their caps differ from the step they were computed at.

Among them, the steps at which the rows come due for a re-probe, in order (`due`): a plain step under load looked
at every row's schedule to find the due ones, about 25 us at 64 rows inside the engine (a quarter of the plan).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import zip_longest
from operator import is_, mul

from services.verifier.request_state import RequestState


def column_gains(survivals: Sequence[Sequence[float]], weights: Sequence[float] | None = None) -> list[float]:
    """Per draft position, the tokens verifying it adds over the rows (each row's survival there, times its
    weight; 0 where a row's survivals stop). Summed a column at a time in C (zip_longest, sum, map): a row at a
    time in Python it was most of a 64-row plan, about 2 us a row on a 2-core EPYC."""
    columns = zip_longest(*survivals, fillvalue=0.0)
    if weights is None:
        return [sum(column) for column in columns]
    return [sum(map(mul, column, weights)) for column in columns]


class PlanRows:
    """The figures of the rows last planned (the module docstring says when they are computed again)."""

    def __init__(self) -> None:
        self.survivals: list[Sequence[float]] = []  # per row, P(position j accepted) for j = 1..its cap
        self.draft_rates: list[float] = []  # per row, how often its proposer has a draft (1.0 without one)
        self.columns: list[float] = []  # column_gains of the survivals weighted by the draft rates
        self.first_wins: list[float] = []  # per row, its first position's survival times its draft rate (a probe's)
        # the rows that may draft (indices) by the planner's step at which each comes due for a re-probe, and
        # those steps, in order
        self._due_rows: list[int] = []
        self._due_steps: list[int] = []
        # of the rows that may draft and were never asked (an ask opens them on the drafter), the tokens each may
        # still write
        self.unopened_remaining: list[int] = []
        self._version = 0  # bumped by `changed`
        self._computed_at: tuple[int, list[RequestState], list[int]] | None = None  # (version, rows, caps)

    def changed(self) -> None:
        """A row's acceptance or draft rate has changed since the last plan."""
        self._version += 1

    @property
    def version(self) -> int:
        """Bumped by each `changed`: equal versions, unchanged figures for the same rows and caps."""
        return self._version

    def read(self, decode: Sequence[RequestState], caps: Sequence[int],
             survival: Callable[[RequestState, int], Sequence[float]]) -> None:
        """The figures of `decode` at `caps` (`survival(state, cap)`: a row's survival by position), computed
        again only where they may differ from the last ones."""
        caps = list(caps)
        if self._computed_at is not None:
            version, rows, known_caps = self._computed_at
            if (version == self._version and known_caps == caps and len(rows) == len(decode)
                    and all(map(is_, rows, decode))):
                return
        self.survivals = [survival(state, cap) for state, cap in zip(decode, caps, strict=True)]
        self.draft_rates = [1.0 if s.speculation is None else s.speculation.drafts.rate for s in decode]
        self.columns = column_gains(self.survivals, self.draft_rates)
        self.first_wins = [survival[0] * rate if survival else 0.0
                           for survival, rate in zip(self.survivals, self.draft_rates, strict=True)]
        by_due_step = sorted((state.speculation.probe.due_at, i)
                             for i, (state, cap) in enumerate(zip(decode, caps, strict=True))
                             if cap > 0 and state.speculation is not None)
        self._due_steps = [step for step, _ in by_due_step]
        self._due_rows = [i for _, i in by_due_step]
        self.unopened_remaining = [decode[i].request.sampling.max_tokens - decode[i].num_output_tokens
                                   for i in self._due_rows if not decode[i].speculation.asked_before]
        self._computed_at = (self._version, list(decode), caps)

    def any_due(self, step: int) -> bool:
        """Whether some row of the last read is due for a re-probe at `step` (as `due`, without listing them)."""
        return bool(self._due_steps) and self._due_steps[0] <= step

    def due(self, step: int) -> list[int]:
        """The rows (indices) that may draft and are due for a re-probe at the planner's `step`, as of the last read
        (a schedule that moves is a change: `changed`), longest due first."""
        return self._due_rows[: bisect_right(self._due_steps, step)]
