"""A plain plan repeated for a few steps without planning again, while nothing it weighed has changed.

Under load most steps ask for no drafts (at 64 chats an H200's EAGLE-3 asked at 7 of 386 steps), and each of them
still planned: every row's survival and draft rate, the column sums, the forward's price at each width, the
drafting's, the probes due. At 64 rows on the simulated H200 step (engine_host_cost's chat text) that was about
0.15-0.3 ms of host work a step beside a step of about 7 ms, the largest part of what speculation costs a load that
does not speculate. A plan that chose width 1 and probed nothing therefore stands for the next steps, up to
QUIET_STEPS in all, as long as:
- no row's figures changed (PlanRows.version: a verified draft, an ask, a probe's schedule; none happens in a
  plain step, so this holds until something is asked);
- no row joined (a new row brings its own estimate, which may be worth asking), and no row's cap grew (a row
  that could not draft now can); rows that left only take their gains with them, and smaller caps only lower what
  asking is worth;
- no probe could be granted now, i.e. not both a row due for a re-probe and the probe credit to pay for one (the
  full plan decides whether it does, and which rows ask). Under load most steps have rows due that wait for the
  credit (probes are rationed to 1% of step time): waiting on due rows alone, a plain plan stood at 12 of 974
  steps at 64 rows.
What it leaves unweighed meanwhile moves slowly: the context, one token longer a step; the cost model's refit and a
stale drafting figure's fade (both at most QUIET_STEPS - 1 steps late). Lossless either way: which positions a
step verifies never depends on the target's randomness for them.

Measured (in one process alternating QUIET_STEPS 4 and 1, engine_host_cost's chat text on the simulated H200
step, eagle-sim and ngram): a plan stood at 60-70% of the steps at 8 and 64 rows, and the first plan's time a step
fell 190-320 -> 120-190 us at 64 rows and 63-119 -> 39-75 us at 8. Tokens a second moved within this machine's
run-to-run noise (about 5%), which is larger than the 1-2% of step time saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.verifier.request_state import RequestState

QUIET_STEPS = 4  # steps one plain plan stands for, its own included


@dataclass
class QuietPlan:
    """What a plain plan weighed (its rows and their caps, the row figures' version) and what the steps it stands for
    reuse of it: the plain step predicted for its rows, and a probe's predicted cost (the probe credit still
    accrues)."""

    version: int
    plain_s: float
    probe_s: float
    caps: dict[str, int] = field(default_factory=dict)  # by request id
    steps: int = 1  # the steps it has stood for, its own included

    @classmethod
    def of(cls, decode: Sequence[RequestState], caps: Sequence[int], version: int, plain_s: float,
           probe_s: float) -> QuietPlan:
        return cls(version, plain_s, probe_s,
                   {state.request_id: cap for state, cap in zip(decode, caps, strict=True)})

    def stands(self, decode: Sequence[RequestState], caps: Sequence[int], version: int,
               probe_grantable: bool) -> bool:
        """Whether it stands for one more step over `decode` at `caps` (counted if so); `probe_grantable`: a probe
        could be granted at this step."""
        if self.steps >= QUIET_STEPS or version != self.version or probe_grantable:
            return False
        known = self.caps
        for state, cap in zip(decode, caps, strict=True):
            if cap > known.get(state.request_id, -1):  # a row that joined, or whose cap grew
                return False
        self.steps += 1
        return True
