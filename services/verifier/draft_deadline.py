"""How long a step waits for a proposer's drafts: long enough for what its drafts are known to take, short enough
that a hung drafter costs little.

A fixed deadline fits a lookup drafter (n-gram, suffix: milliseconds) but not a draft model, whose K sequential
forwards on a CPU can take longer than any fixed figure chosen for lookups. Missing it is worse than waiting: the
step goes on without drafts while the drafter keeps computing, and on a machine they share the two then slow each
other down, so the next call is late too (measured with Qwen2.5-Coder-0.5B drafting for the 1.5B on 2 cores: 59
missed deadlines in one benchmark round, and four concurrent requests at 0.4-0.9x no speculation).

So the deadline follows the proposer, as a TCP retransmission timeout follows the round trip: DEADLINE_FACTOR times
the predicted time of a call drafting k tokens for its rows (draft_cost.DraftCostModel over the calls that
answered), never below the configured floor (`draft_timeout_s`) nor above the cap (`max_draft_timeout_s`). A
drafter that has never answered within the floor keeps the floor: a hung or far too slow drafter costs each step
what it cost before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.verifier.draft_cost import DraftCostModel

DEADLINE_FACTOR = 2.0


@dataclass
class DraftDeadline:
    floor_s: float
    cap_s: float
    cost: DraftCostModel = field(default_factory=DraftCostModel)  # seconds of the calls that answered

    def for_call(self, k: int, rows: int = 1) -> float:
        """Seconds to wait for a call drafting at most `k` tokens for `rows` rows."""
        return min(self.cap_s, max(self.floor_s, DEADLINE_FACTOR * self.cost.predict(k, rows)))

    def answered(self, k: int, seconds: float, rows: int = 1) -> None:
        self.cost.observe(k, seconds, rows=rows)
