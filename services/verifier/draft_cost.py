"""What drafting adds to a step, as a function of the longest draft asked for.

An n-gram or suffix lookup costs about nothing, but a draft model drafts K tokens with K sequential forwards of
its own (batched over the rows), which on a shared CPU can cost more than the verify forward. The planner must
weigh that before asking: a step that asks for no draft does not call the drafter at all, so it pays none of it.

Measured, never configured: each step that asked for drafts reports how long collecting them took and the longest
draft it asked for (k); the model keeps a moving average per k and predicts with a line through them (a fixed part
for the round trip and the catch-up, a part per drafted token), or, while only one k has been seen, proportionally
to k (the draft-model case: the per-token forwards dominate). k = 0 costs nothing.

Forgotten unless measured again: a figure is only ever refreshed by asking, and a high one stops the asking, so a
call that was slow once (a pause, a drafter restarting) would stop speculation for good. So the planner ages the
model once a step (`age`): a figure measured within the last STALE_STEPS steps stands as it is; older, it counts
half after HALF_LIFE_STEPS more, then a quarter, until asking pays again and measures it afresh, and that
measurement replaces it instead of being averaged with it (the probes, which ask now and then whatever the figure
says, reset a figure a pause left high). Not faded while current: a fade from the first step also lowered true
figures, so a batch that asks its drafter once every few dozen steps because asking rarely pays (64 chats over
gRPC) predicted its calls at 0.5-0.8 of what they cost, asked at that price, and lost on those steps
(engine_host_cost's chat text on a simulated H200 step: planned asks took 1.3-4.5% of the step time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest observation in each k's moving average
STALE_STEPS = 100  # steps without a measurement after which a figure fades, and the next one replaces it
HALF_LIFE_STEPS = 100  # steps, once stale, after which a figure not measured again counts half


@dataclass
class DraftCostModel:
    seconds_by_k: dict[int, float] = field(default_factory=dict)  # moving average of collection seconds per k
    measured_at: dict[int, int] = field(default_factory=dict)  # the step each figure was last measured at
    steps: int = 0  # steps aged so far
    observations: int = 0  # calls observed so far
    # (steps, observations) when the line predict() uses was fitted -> that line: a plan prices several k a step
    # (about 2 us each at 64 rows when it was fitted again for each), and the figures change at most once a step
    _fitted: tuple[tuple[int, int], tuple[float, float]] | None = field(default=None, repr=False, compare=False)

    def observe(self, k: int, seconds: float, renews: bool = True) -> None:
        """Collecting drafts of at most `k` tokens took `seconds` (a missed deadline reports the deadline).
        `renews` False (a probe's call): averaged in, but the figure keeps its age unless this replaced it, so a
        figure that only probes measure still goes stale and is replaced (SpeculationPlanner.observe_drafting)."""
        if k <= 0 or seconds < 0:
            return
        previous = self.seconds_by_k.get(k)
        fresh = previous is None or self._age(k) >= STALE_STEPS
        self.seconds_by_k[k] = seconds if fresh else previous + SMOOTHING * (seconds - previous)
        if fresh or renews:
            self.measured_at[k] = self.steps
        self.observations += 1

    def age(self) -> None:
        """One more step has passed (see the module docstring)."""
        self.steps += 1

    def _age(self, k: int) -> int:
        return self.steps - self.measured_at.get(k, self.steps)

    def predict(self, k: int) -> float:
        """Expected seconds to collect drafts of at most `k` tokens; 0 for k = 0 or before any observation."""
        if k <= 0 or not self.seconds_by_k:
            return 0.0
        fixed, per_token = self._line()
        return max(0.0, fixed + per_token * k)

    def _line(self) -> tuple[float, float]:
        """Fixed seconds and seconds a token through the aged figures, fitted again only when a call was observed
        or, while some figure is stale (so fading), when a step has passed. Every step refitted it before, to the
        same line while no figure was fading, in the first plan of every step, where most steps ask nothing. With
        predict_widths (step_cost.py), the first plan at 1 row went from 119 to 104 us (medians of 6 alternated runs
        of engine_host_cost's chat text on a simulated H200 step)."""
        oldest = min(self.measured_at.values(), default=self.steps)
        key = (self.steps if self.steps - oldest > STALE_STEPS else -1, self.observations)
        if self._fitted is None or self._fitted[0] != key:
            figures = {seen: seconds * 0.5 ** (max(0, self._age(seen) - STALE_STEPS) / HALF_LIFE_STEPS)
                       for seen, seconds in self.seconds_by_k.items()}
            if len(figures) == 1:
                (seen, seconds), = figures.items()
                line = (0.0, seconds / seen)
            else:
                line = nonnegative_line(figures)
            self._fitted = (key, line)
        return self._fitted[1]


def nonnegative_line(points: dict[float, float]) -> tuple[float, float]:
    """Least-squares intercept and slope through (x, seconds), neither below 0 (at least two points)."""
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
