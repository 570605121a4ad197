"""A decoding request's speculation state in the engine: its acceptance estimate and when it is next re-probed
(speculation_planner.py explains why rows at K = 0 are re-probed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.verifier.acceptance import AcceptanceEstimate, DraftRate

PROBE_INTERVAL = 8  # steps without a verified draft before a row is re-probed
PROBE_INTERVAL_MAX = 128
PROBE_TIME_SHARE = 0.01  # at most this share of step time pays for probe columns
PROBE_CHARGE_STEPS = 4  # a probing step's excess is charged at most this many plain steps, + 1 a row it opened


@dataclass
class ProbeSchedule:
    """When a row at K = 0 next verifies one position anyway: more than `interval` of the planner's steps after its
    last verified draft (or its start). Counted on the planner's step clock, so that a step touches nothing of a row
    it did not verify: counted row by row, the rows' idle steps cost 2 us a row a step at 64 rows (1.6% of a
    simulated H200 step, engine_host_cost's chat text)."""

    interval: int = PROBE_INTERVAL
    since: int = 0  # the planner's step at the row's last verified draft (or its start)

    @property
    def due_at(self) -> int:
        """The planner's first step at which the row is due."""
        return self.since + self.interval + 1

    def due(self, now: int) -> bool:
        return now >= self.due_at

    def verified(self, probed: bool, num_accepted: int, now: int) -> None:
        self.since = now
        if probed:
            self.interval = PROBE_INTERVAL if num_accepted else min(2 * self.interval, PROBE_INTERVAL_MAX)

    def unanswered(self, now: int) -> None:
        """A probe came back without a draft (an n-gram drafter on new text has none): the call was paid for, so it
        backs off as a rejected probe does. Counted as idle instead, the row stayed due and asked its drafter again
        every step: a round trip each step for nothing, about a quarter of a 3.4 ms accelerator step."""
        self.verified(True, 0, now)


@dataclass
class ProbeBudget:
    """The batch's allowance for probes. A probe that widens a step from 1 to 2 positions makes every row of the
    batch pay for that column (a quarter of the step for 16 rows on a CPU), and a step that asks its drafter only
    for probes pays the drafting call (a gRPC round trip: 0.5-1.5 ms, a large share of an accelerator's step), so
    probes are rationed by time: each step earns PROBE_TIME_SHARE of its predicted time, a probe is granted when
    the credit covers what it is predicted to cost less what its rows are expected to win, and is then charged
    what its step really cost less the tokens it won (SpeculationPlanner.settle_probe), and rows that are due
    wait until the batch can afford one (then every due row probes in that same call and column)."""

    credit_s: float = 0.0

    def earn(self, step_s: float, probe_s: float) -> bool:
        """Credit for one step; True if a probe costing `probe_s` is affordable now."""
        self.credit_s = self._earned(step_s, probe_s)
        return self.credit_s >= probe_s

    def would_afford(self, step_s: float, probe_s: float) -> bool:
        """What `earn(step_s, probe_s)` would answer, without earning."""
        return self._earned(step_s, probe_s) >= probe_s

    def _earned(self, step_s: float, probe_s: float) -> float:
        """The credit after one more step's share, kept within two probes' cost."""
        return min(self.credit_s + PROBE_TIME_SHARE * step_s, 2 * probe_s)

    def spend(self, seconds: float) -> None:
        self.credit_s -= seconds


@dataclass
class ProbeStep:
    """A step that probes, until it is settled (SpeculationPlanner.settle_probe): what it was predicted to take
    without its probes, what its probes were charged so far, what a token is worth in it, and the tokens they won."""

    expected_s: float
    charged_s: float
    token_s: float
    won_tokens: int = 0
    opened: int = 0  # rows it asked for the first time (each opened on the drafter: charged apart, settle_probe)


@dataclass
class RowSpeculation:
    """A decoding request's speculation state in the engine (on RequestState)."""

    acceptance: AcceptanceEstimate
    probe: ProbeSchedule = field(default_factory=ProbeSchedule)
    drafts: DraftRate = field(default_factory=DraftRate)
    asked_before: bool = False  # a step asked its proposer for a draft (the first call opens the sequence there)
    probing: bool = False  # this step asked it as a probe
    # a tree row: what its trees' j-th best node was worth against a chain's j-th token, by j (SpeculationPlanner.
    # _observe_tree_yield); empty: no tree seen yet, valued as a chain
    tree_yield: list[float] = field(default_factory=list)
