"""A decoding request's speculation state in the engine: its acceptance estimate and when it is next re-probed
(speculation_planner.py explains why rows at K = 0 are re-probed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.verifier.acceptance import AcceptanceEstimate, DraftRate

PROBE_INTERVAL = 8  # steps without a verified draft before a row is re-probed
PROBE_INTERVAL_MAX = 128


@dataclass
class ProbeSchedule:
    """When a row at K = 0 next verifies one position anyway."""

    interval: int = PROBE_INTERVAL
    idle_steps: int = 0

    @property
    def due(self) -> bool:
        return self.idle_steps >= self.interval

    def verified(self, probed: bool, num_accepted: int) -> None:
        self.idle_steps = 0
        if probed:
            self.interval = PROBE_INTERVAL if num_accepted else min(2 * self.interval, PROBE_INTERVAL_MAX)

    def idle(self) -> None:
        self.idle_steps += 1


@dataclass
class RowSpeculation:
    """A decoding request's speculation state in the engine (on RequestState)."""

    acceptance: AcceptanceEstimate
    probe: ProbeSchedule = field(default_factory=ProbeSchedule)
    drafts: DraftRate = field(default_factory=DraftRate)
    asked: bool = False  # this step asked the proposer for a draft
    probing: bool = False  # ... as a probe
