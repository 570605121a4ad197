"""What drafting adds to a step, as a function of the longest draft asked for.

An n-gram or suffix lookup costs about nothing, but a draft model drafts K tokens with K sequential forwards of
its own (batched over the rows), which on a shared CPU can cost more than the verify forward. The planner must
weigh that before asking: a step that asks for no draft does not call the drafter at all, so it pays none of it.

Measured, never configured: each step that asked for drafts reports how long collecting them took and the longest
draft it asked for (k); the model keeps a moving average per k and predicts with a line through them (a fixed part
for the round trip and the catch-up, a part per drafted token), or, while only one k has been seen, proportionally
to k (the draft-model case: the per-token forwards dominate). k = 0 costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest observation in each k's moving average


@dataclass
class DraftCostModel:
    seconds_by_k: dict[int, float] = field(default_factory=dict)  # moving average of collection seconds per k

    def observe(self, k: int, seconds: float) -> None:
        """Collecting drafts of at most `k` tokens took `seconds` (a missed deadline reports the deadline)."""
        if k <= 0 or seconds < 0:
            return
        previous = self.seconds_by_k.get(k)
        self.seconds_by_k[k] = seconds if previous is None else previous + SMOOTHING * (seconds - previous)

    def predict(self, k: int) -> float:
        """Expected seconds to collect drafts of at most `k` tokens; 0 for k = 0 or before any observation."""
        if k <= 0 or not self.seconds_by_k:
            return 0.0
        if len(self.seconds_by_k) == 1:
            (seen, seconds), = self.seconds_by_k.items()
            return seconds * k / seen
        fixed, per_token = _line(self.seconds_by_k)
        return max(0.0, fixed + per_token * k)


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares intercept and slope through (k, seconds), neither below 0."""
    n = len(points)
    mean_k = sum(points) / n
    mean_s = sum(points.values()) / n
    spread = sum((k - mean_k) ** 2 for k in points)
    slope = max(0.0, sum((k - mean_k) * (s - mean_s) for k, s in points.items()) / spread)
    intercept = mean_s - slope * mean_k
    if intercept < 0:  # through the origin instead
        slope = sum(k * s for k, s in points.items()) / sum(k * k for k in points)
        intercept = 0.0
    return intercept, slope
