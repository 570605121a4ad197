"""What drafting adds to a step, as a function of the longest draft asked for and of how many rows were asked.

An n-gram or suffix lookup costs about nothing, but a draft model drafts K tokens with K sequential forwards of
its own (batched over the rows), which on a shared CPU can cost more than the verify forward. The planner must
weigh that before asking: a step that asks for no draft does not call the drafter at all, so it pays none of it.

Measured, never configured: each step that asked for drafts reports how long collecting them took, the longest
draft it asked for (k) and the rows it asked. Asks are kept apart by how many rows they asked (1, 2-3, 4-7, ...:
powers of two, as cost_by_rows.py keeps a step's bookkeeping): within a class, a moving average per k, predicted
with a line through them (a fixed part for the round trip and the catch-up, a part per drafted token), or, while
only one k has been seen, proportionally to k (the draft-model case: the per-token forwards dominate). An ask of a
class not measured yet is priced by a line through the measured classes' figures at that k by their rows (a part
per call, a part per row asked), or the one class's figure while one is known. k = 0 costs nothing.

Why by rows: a drafter service handles each row it is asked about (its new tokens on the link, its lookup or its
draft model's rows), so an ask of every row of a batch costs several times an ask of the few rows a probe asks.
Priced as one figure, the probes' cheap calls priced the batch's: at 64 chats over gRPC an ask of every row took
8-24 ms against a 7-8 ms step and was predicted at 0.6-8.6 ms (engine_host_cost's chat text on a simulated H200
step, ngram).

Forgotten unless measured again: a figure is only ever refreshed by asking, and a high one stops the asking, so a
call that was slow once (a pause, a drafter restarting) would stop speculation for good. So the planner ages the
model once a step (`age`): a figure measured within the last STALE_STEPS steps stands as it is; older, it counts
half after HALF_LIFE_STEPS more, then a quarter, until asking pays again and measures it afresh, and that
measurement replaces it instead of being averaged with it (the probes, which ask now and then whatever the figure
says, reset a figure a pause left high). Not faded while current: a fade from the first step also lowered true
figures, so a batch that asks its drafter once every few dozen steps because asking rarely pays (64 chats over
gRPC) predicted its calls at 0.5-0.8 of what they cost, asked at that price, and lost on those steps
(engine_host_cost's chat text on a simulated H200 step: planned asks took 1.3-4.5% of the step time). The fade
moves every FADE_REFRESH_STEPS steps rather than every step, so that what a plan prices is worked out once for
those steps (a fading figure changes by 7% across them).

A row's first ask opens it on the drafter (the whole prompt; for EAGLE its target states and the head's prefill),
once per request: an ask that opens rows costs its class's figure plus that much a row opened (`opening_s`, one
figure for every class). Such asks were left out of the figures once, so that a first call's 16 ms over gRPC (0.5 a
call after it) would not stop the asking. But under a steady load every ask of a batch opens the rows that arrived
since the one before: at 64 rows 31 of 38 asks in a run opened some, the figures came from the other 7, faded stale
between them (eagle-sim, below), and the plan did not price the openings at all (an H200's EAGLE-3 at 64 chats: 5
of its 7 asks opened rows, 52.8 ms each against a 7 ms step). So an opening ask teaches both: what it took beyond
what the figures say such an ask takes (its class's, or the line through the others') is the openings', and what it
took less them its class's. Before any figure it is left out, as before. The plan prices an ask's openings, each
shared among the asks its row can expect (SpeculationPlanner.draft_requests).

A class's figures fade toward the lowest of its last few measurements at any k (LOWEST_OF), once it has two, not
toward nothing; that floor fades too, ten times slower. Why: an ask that rarely pays is rarely measured, however
true its figure. At 64 rows an EAGLE-like drafter's ask of every row cost 13-19 ms against a 5 ms step; its figures,
not measured for a few hundred steps, faded to 0.3 ms, so the planner asked again, paid, measured, stopped, and so
on: 4-8 asks and 2 probes of most rows in a run of about 570 steps, which took 1.7-2.8 times what the plan said
(engine_host_cost's chat text, eagle-sim, on a simulated H200 step: 0.87-0.91x none at 64 rows; on an H200
EAGLE-3 at 64 chats asked 7 times in 386 steps, at 0.89x). Any k: such asks come at several k (the plan's width
differs from one to the next) and probes at k = 1, each measured once. Below what the class's figures say unfaded
only: a floor from a larger k does not price a smaller one above its own current figure. A class measured once
fades as before: a first call that met one-time costs (a graph captured inside it) must not hold the asking back
once it has faded, and the next measurement gives the floor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest observation in each k's moving average, and in a class's mean rows
STALE_STEPS = 100  # steps without a measurement after which a figure fades, and the next one replaces it
HALF_LIFE_STEPS = 100  # steps, once stale, after which a figure not measured again counts half
LOWEST_OF = 4  # a class's figures fade toward the lowest of its last this many measurements (once it has two)
FLOOR_HALF_LIFE_STEPS = 10 * HALF_LIFE_STEPS  # ... and that floor, once stale, counts half after this many steps
FADE_REFRESH_STEPS = 10  # a fading figure's age is counted in steps of this many


@dataclass
class RowClassAsks:
    """The asks of one class of row counts (1, 2-3, 4-7, ...): the rows they asked (a moving average) and, per k,
    the moving average of their collection seconds and the step it was last measured at."""

    rows: float
    seconds_by_k: dict[int, float] = field(default_factory=dict)
    measured_at: dict[int, int] = field(default_factory=dict)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=LOWEST_OF))  # its last measurements, any k


@dataclass
class DraftCostModel:
    classes: dict[int, RowClassAsks] = field(default_factory=dict)  # rows.bit_length() -> its asks
    steps: int = 0  # steps aged so far
    observations: int = 0  # calls observed so far
    oldest: int = 0  # the step the least recently measured figure was measured at
    _opening_s: float = 0.0  # the average of what asks took beyond their figure, per row opened (opening_s)
    openings_known: bool = False
    # (fade's step, observations) when the predictions below were worked out -> {(k, rows): seconds}: a plan prices
    # several k a step (about 2 us each at 64 rows when the line was fitted again for each), and the figures change
    # at most once a step
    _predicted: tuple[tuple[int, int], dict[tuple[int, int], float]] | None = field(default=None, repr=False,
                                                                                    compare=False)

    def observe(self, k: int, seconds: float, renews: bool = True, rows: int = 1) -> None:
        """Collecting drafts of at most `k` tokens for `rows` rows took `seconds` (a missed deadline reports the
        deadline). `renews` False (a probe's call): averaged in, but the figure keeps its age unless this replaced
        it, so a figure that only probes measure still goes stale and is replaced (SpeculationPlanner.
        observe_drafting)."""
        if k <= 0 or seconds < 0:
            return
        rows = max(1, rows)
        asks = self.classes.get(rows.bit_length())
        if asks is None:
            asks = self.classes[rows.bit_length()] = RowClassAsks(float(rows))
        else:
            asks.rows += SMOOTHING * (rows - asks.rows)
        previous = asks.seconds_by_k.get(k)
        fresh = previous is None or self.steps - asks.measured_at[k] >= STALE_STEPS
        asks.seconds_by_k[k] = seconds if fresh else previous + SMOOTHING * (seconds - previous)
        asks.recent.append(seconds)
        if fresh or renews:
            asks.measured_at[k] = self.steps
        self.oldest = min(min(asks.measured_at.values()) for asks in self.classes.values())
        self.observations += 1

    def observe_opening(self, k: int, seconds: float, renews: bool, rows: int, opened: int) -> None:
        """An ask of `rows` rows, `opened` of them asked for the first time, took `seconds`: what it took beyond what
        the figures say such an ask takes is the openings', a row opened each; what it took less the openings is
        its class's (module docstring). Before any figure, left out: nothing tells a first call's own costs apart."""
        if k <= 0 or seconds < 0 or opened <= 0:
            return
        expected = self.predict(k, rows)
        if expected <= 0:
            return
        # each ask's excess averaged as it is, below 0 too: where openings cost nothing, asks above their figure and
        # asks below it cancel out (clipped at 0 each, the noise alone made a cost of them); opening_s clips the mean
        extra = (seconds - expected) / opened
        self._opening_s = extra if not self.openings_known else self._opening_s + SMOOTHING * (extra - self._opening_s)
        self.openings_known = True
        self.observe(k, max(0.0, seconds - self.opening_s * opened), renews, rows)

    @property
    def opening_s(self) -> float:
        """What a row's first ask adds to the call, per row opened (0 until known)."""
        return max(0.0, self._opening_s)

    def age(self) -> None:
        """One more step has passed (see the module docstring)."""
        self.steps += 1

    def predict(self, k: int, rows: int = 1) -> float:
        """Expected seconds to collect drafts of at most `k` tokens for `rows` rows; 0 for k = 0 or before any
        observation. Worked out again only when a call was observed or, while some figure fades, every
        FADE_REFRESH_STEPS steps: the first plan of every step prices several k, and most steps ask nothing. Worked
        out once a step instead of at each price, and with predict_widths (step_cost.py), the first plan at 1 row
        went from 119 to 104 us (medians of 6 alternated runs of engine_host_cost's chat text on a simulated H200
        step)."""
        if k <= 0 or not self.classes:
            return 0.0
        now = self.steps - self.steps % FADE_REFRESH_STEPS
        key = (now if now - self.oldest > STALE_STEPS else -1, self.observations)
        if self._predicted is None or self._predicted[0] != key:
            self._predicted = (key, {})
        known = self._predicted[1]
        found = known.get((k, rows))
        if found is None:
            found = known[(k, rows)] = self._worked_out(k, max(1, rows), now)
        return found

    def _worked_out(self, k: int, rows: int, now: int) -> float:
        """Its own class's figure where that class was measured, else a line through the others' by their rows.
        The own class first: asks of other sizes say little about it, and a class a pause left high pulled the line
        up for every size until it faded."""
        own = self.classes.get(rows.bit_length())
        if own is not None:
            return self._class_seconds(own, k, now)
        by_rows = {asks.rows: self._class_seconds(asks, k, now) for asks in self.classes.values()}
        if len(by_rows) == 1:
            (seconds,) = by_rows.values()
            return seconds
        fixed, per_row = nonnegative_line(by_rows)
        return fixed + per_row * rows

    @staticmethod
    def _class_seconds(asks: RowClassAsks, k: int, now: int) -> float:
        """One class's figure at k: through its figures faded to `now`, proportional to k from one, a line from
        more; not below its floor while that is below the figure unfaded (module docstring)."""
        stale = {seen: max(0, now - at - STALE_STEPS) for seen, at in asks.measured_at.items()}
        figure = figure_at(k, {seen: seconds * 0.5 ** (stale[seen] / HALF_LIFE_STEPS)
                               for seen, seconds in asks.seconds_by_k.items()})
        if len(asks.recent) < 2 or not any(stale.values()):
            return figure
        floor = min(asks.recent) * 0.5 ** (min(stale.values()) / FLOOR_HALF_LIFE_STEPS)
        return max(figure, min(floor, figure_at(k, asks.seconds_by_k)))


def figure_at(k: int, figures: dict[int, float]) -> float:
    """Seconds at k from figures by k: proportional to k from one, a line from more."""
    if len(figures) == 1:
        (seen, seconds), = figures.items()
        return seconds * k / seen
    fixed, per_token = nonnegative_line(figures)
    return max(0.0, fixed + per_token * k)


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
