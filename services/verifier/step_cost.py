"""What a verify forward costs, as a function of its shape: profiled at start-up on the actual device, refined
with every step the engine times.

The decode rows of a step run as one padded forward: `rows` rows of `width` positions each (the last committed
token plus up to width - 1 drafts), attending to at most `span` positions of context. Its time is modelled as

    seconds = c0 + c1 * rows + c2 * tokens + c3 * rows * span / 1024 + c4 * tokens * span / 1024
              + verify * (c5 + c6 * rows * span / 1024),    tokens = rows * width, verify = 1 if width > 1

(weights read once per forward; per-row work; per-token matmuls; each row's context read once; attention over
the context per token; and what a forward of more than one token a row costs at all). The model is fitted by
non-negative least squares over the *median* time of each observed shape, so a noisy spell on a shared machine
moves one sample of a shape, not the fit, and a cost never falls as a forward grows. Each shape weighs in as often
as steps ran it lately (its observations, halved every WEIGHT_HALF_LIFE observations since), so that the fit is
right where the steps are: weighed alike, the hundred shapes a batch of 64 passes through once each while it
drains and refills (39-63 rows, each at its own context) outweighed the few shapes at 64 rows that most steps run,
and a plain step at 64 chats was predicted at 7.2 ms where it took 5.5 (engine_host_cost's chat text on a
simulated H200 step; 5.9 weighed): the planner took a plain step for dearer than it was, and asked for drafts
where they lost. Only the four terms c0, c1,
c2 and c4 are fitted until the shapes seen show, by predicting shapes left out of the fit, that all seven do
clearly better (choose_terms): a start-up profile's few shapes cannot pin seven down.

Why not a constant per token: on a CPU the weights are read once per forward whatever its width (verifying 9
positions costs ~1.2x one position for a single row), while a batch of 8 rows pays ~0.9 ms per extra token
(SmolLM2-135M, 2 cores). Why the verify terms: on an H100 a captured step of 2 to 9 tokens a row cost about the
same, and all more than one of 1 token (one row over 512 positions: 1.84 ms at width 1, 2.20-2.25 at widths
2-9; over 4,096: 2.25 against 4.10-4.15): the extra grew with the span, not the width, so attention. The four
terms of before (c0, c1, c2, c4) fitted that table (step_host_profile's, 75 shapes) with a median error of 26% and
priced a first draft column at nothing (width 2 at 1.00x width 1, against 1.20x measured), so the planner bought
one- and two-token drafts that cost a fifth of a step each; with the row-span and verify terms the median error
is 4% (tests/unit/test_step_cost.py holds the fit to that table). The planner needs the slope at the shape it is
about to run, on this machine.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from operator import mul
from typing import NamedTuple

import numpy as np
import torch

from services.common.growing_rows import GrowingRows
from services.modeling.runner import ModelRunner, RowInput

logger = logging.getLogger(__name__)

SAMPLES_PER_SHAPE = 9  # the median of the last this many timings of a shape stands for it
SPAN_BUCKET = 64  # context spans within one bucket count as one shape
REFIT_EVERY = 16  # observations between fits
MIN_SHAPES = 4  # distinct shapes before the fit is trusted (the four base terms)
BASE_TERMS = (0, 1, 2, 4)  # c0, c1, c2, c4: what a few shapes at one or two context lengths pin down
ALL_TERMS = tuple(range(7))
CROSS_VALIDATION_FOLDS = 5
# all seven terms are fitted only where they predict shapes left out of the fit clearly better than the base four
# do (a held-out median error at most this share of the base's), and only from this many shapes
ALL_TERMS_ERROR_SHARE = 0.8
BASE_GOOD_ENOUGH = 0.02  # a held-out median error of the base terms below which they are kept
TERMS_REGROWTH = 1.25  # the terms are chosen again once the shapes known grew by a quarter
ALL_TERMS_MIN_SHAPES = 2 * len(ALL_TERMS)  # a GPU start-up profile has 18 (3 row counts x 3 widths x 2 contexts)
PROFILE_REPEATS = 3
PROFILE_CONTEXT = 128
# Seconds the start-up profile may take: past it (with MIN_SHAPES shapes timed), no further shape is profiled (a
# large model on a small CPU, 0.5 s a forward, would otherwise take minutes); the model keeps learning from steps.
PROFILE_BUDGET_S = 5.0
PROFILE_SEQUENCE_PREFIX = "specserve-cost-profile-"
PADDED_SHAPES = 4096  # (rows, width, span) paddings remembered: a step predicts up to a tree's width of them
WEIGHT_HALF_LIFE = 1000  # observations after which a shape's past observations count half in its weight


class StepShape(NamedTuple):
    """A verify forward's shape. A named tuple, not a frozen dataclass: a plan predicts several shapes a step, and
    a frozen dataclass took 1.2 us to build (a named tuple 0.4) on a 2-core EPYC."""

    rows: int
    width: int  # positions per row (1 + the longest draft)
    span: int  # context positions the widest row attends to

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    def features(self) -> list[float]:
        return shape_features(self.rows, self.width, self.span)


def shape_features(rows: int, width: int, span: int) -> list[float]:
    """The fit's terms of a forward of `rows` rows of `width` positions attending to `span` (StepShape.features)."""
    tokens = rows * width
    row_context, verify = rows * span / 1024.0, float(width > 1)
    return [1.0, float(rows), float(tokens), row_context, tokens * span / 1024.0, verify, verify * row_context]


def non_negative_least_squares(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares with every coefficient >= 0 (an active set: drop the most negative feature and refit),
    enough for seven features; numpy has no NNLS and scipy is not a dependency. `weights`: how much each row's
    squared error counts (None: alike)."""
    if weights is not None:
        scale = np.sqrt(weights)
        x, y = x * scale[:, None], y * scale
    active = list(range(x.shape[1]))
    coefficients = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coefficients


class StepCostModel:
    """`padding`: the shape a forward of a given shape really runs at (the runner's padded_shape: on an
    accelerator, its captured graph's rows, width bucket and span). Its rows and width replace a shape's in every
    shape observed and predicted, so that widths one graph pads alike cost alike: on an H100 a row of 2 to 9
    tokens replayed in about the same time, and a planner pricing each token apart paid for a padded width 9 to
    verify 6. The span is kept as given: the start-up profile's two short contexts would both pad to the graphs'
    span floor, leaving half its shapes (too few to fit the verify terms), and the span terms are smooth anyway.
    None: shapes as given (CPU, eager forwards)."""

    def __init__(self, padding: Callable[[int, int, int], tuple[int, int, int]] | None = None) -> None:
        self._padding = None if padding is None else functools.lru_cache(maxsize=PADDED_SHAPES)(padding)
        self._samples: dict[tuple[int, int, int], deque[float]] = {}
        self._shapes: dict[tuple[int, int, int], StepShape] = {}
        # What the fit reads of each shape, by its index (the order shapes were first observed, as `_samples`): its
        # features (a row each), the median of its samples as of the last fit (worked out again for the shapes
        # observed since: `_changed`), and its weight's parts (observations, halved as they age; when last seen).
        # Shapes are never forgotten (a shape seen long ago may be all that pins a term down), and a long-running
        # server meets thousands (rows, widths and context spans of 64 positions). Built again from the samples at
        # each fit (every REFIT_EVERY steps), a fit took 2.8 ms at 2,179 shapes, most of it features and medians
        # in Python; kept, 0.31 ms (2-core EPYC). In the engine at 64 rows (engine_host_cost's chat text, 160-190
        # shapes, choosing terms included) 0.70-0.76 -> 0.48-0.56 ms a fit.
        self._index: dict[tuple[int, int, int], int] = {}
        self._features = GrowingRows()
        self._medians: list[float] = []
        self._counts: list[float] = []
        self._seen_at: list[int] = []
        self._changed: set[tuple[int, int, int]] = set()
        self._coefficients: tuple[float, ...] | None = None
        self._terms: tuple[int, ...] = BASE_TERMS
        self._terms_chosen_at = 0  # shapes known when the terms were last chosen
        self._pending = 0
        self.num_observations = 0

    @classmethod
    def for_runner(cls, runner: ModelRunner) -> StepCostModel:
        """A model that prices the shapes `runner` really runs (its padded_shape, where it has one)."""
        return cls(getattr(runner, "padded_shape", None))

    @property
    def fitted(self) -> bool:
        return self._coefficients is not None

    def padded(self, shape: StepShape) -> StepShape:
        """`shape` with the rows and width its forward runs at (itself without padding)."""
        if self._padding is None:
            return shape
        rows, width, _ = self._padding(shape.rows, shape.width, shape.span)
        return StepShape(rows, width, shape.span)

    def observe(self, shape: StepShape, seconds: float) -> None:
        shape = self.padded(shape)
        key = (shape.rows, shape.width, shape.span // SPAN_BUCKET)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=SAMPLES_PER_SHAPE)
            self._shapes[key] = shape
            self._index[key] = len(self._medians)
            self._features.append(np.array([shape.features()]))
            self._medians.append(seconds)
            self._counts.append(0.0)
            self._seen_at.append(0)
        samples.append(seconds)
        i = self._index[key]
        self._counts[i] = self._weight(i) + 1.0
        self._seen_at[i] = self.num_observations
        self._changed.add(key)
        self.num_observations += 1
        self._pending += 1
        if self._pending >= REFIT_EVERY or (self._coefficients is None and len(self._samples) >= MIN_SHAPES):
            self.fit()

    def _weight(self, i: int) -> float:
        """How often steps ran shape `i` lately (module docstring)."""
        return self._counts[i] * 0.5 ** ((self.num_observations - self._seen_at[i]) / WEIGHT_HALF_LIFE)

    def samples(self) -> list[tuple[int, int, int, list[float]]]:
        """(rows, width, span, seconds) per observed shape: what step_cost_cache.py stores."""
        return [(shape.rows, shape.width, shape.span, list(self._samples[key])) for key, shape in self._shapes.items()]

    def restore(self, samples: list[tuple[int, int, int, list[float]]]) -> None:
        """Observe stored samples (as a profile would have) and fit."""
        for rows, width, span, seconds in samples:
            for value in seconds:
                self.observe(StepShape(rows, width, span), value)
        self.fit()

    def fit(self) -> None:
        """Refit on the median of each shape. Until MIN_SHAPES shapes are known (from the start-up profile or from
        steps), there is no fit and predictions are 0: the planner then keeps every row's full K. Which terms are
        fitted is chosen again (choose_terms) whenever the shapes known grew by a quarter."""
        self._pending = 0
        shapes = len(self._medians)
        if shapes < MIN_SHAPES:
            return
        for key in self._changed:
            self._medians[self._index[key]] = statistics.median(self._samples[key])
        self._changed.clear()
        x, y = self._features.view(), np.array(self._medians)
        if shapes >= TERMS_REGROWTH * self._terms_chosen_at:  # at first 0: shapes >= MIN_SHAPES > 0
            self._terms, self._terms_chosen_at = choose_terms(x, y), shapes  # 10 small fits: not every refit
        coefficients = np.zeros(len(ALL_TERMS))
        ages = self.num_observations - np.array(self._seen_at, dtype=np.float64)
        weights = np.array(self._counts) * 0.5 ** (ages / WEIGHT_HALF_LIFE)
        coefficients[list(self._terms)] = non_negative_least_squares(x[:, self._terms], y, weights)
        self._coefficients = tuple(float(c) for c in coefficients)

    def predict(self, shape: StepShape) -> float:
        """Seconds for a forward of this shape (0 before any observation: the planner then keeps the full K)."""
        if self._coefficients is None:
            return 0.0
        # plain floats, multiplied in C (map): the planner predicts a few shapes every step, and numpy's per-call cost
        # was most of it (then a generator's, 2.2 us of 4.3)
        return sum(map(mul, self._coefficients, self.padded(shape).features()))

    def predict_widths(self, rows: int, span: int, widest: int) -> list[float]:
        """predict(StepShape(rows, width, span + width)) for each width 1..`widest`: the same figures, without the
        two shapes and the calls a width that predict() makes. The first plan prices every width each step
        (draft_cost.DraftCostModel.predict says what the two together saved)."""
        coefficients = self._coefficients
        if coefficients is None:
            return [0.0] * widest
        seconds = []
        for width in range(1, widest + 1):
            span_then = span + width
            padded = (rows, width) if self._padding is None else self._padding(rows, width, span_then)[:2]
            seconds.append(sum(map(mul, coefficients, shape_features(*padded, span_then))))
        return seconds

    def describe(self) -> str:
        if self._coefficients is None:
            return "no step-cost observations yet"
        c0, c1, c2, c3, c4, c5, c6 = (1e3 * c for c in self._coefficients)
        text = f"verify forward ~ {c0:.2f} ms + {c1:.3f} ms/row + {c2:.3f} ms/token + {c4:.4f} ms/token"
        if self._terms == BASE_TERMS:
            return f"{text} per 1024 context positions ({len(self._samples)} shapes)"
        return (f"{text} and {c3:.4f} ms/row per 1024 context positions; more than one token a row: + {c5:.3f} ms "
                f"+ {c6:.4f} ms/row per 1024 context positions ({len(self._samples)} shapes)")


def choose_terms(x: np.ndarray, y: np.ndarray) -> tuple[int, ...]:
    """BASE_TERMS, or ALL_TERMS where they predict the shapes each fold leaves out clearly better. Why: seven
    coefficients fitted to the few shapes of a start-up profile (one or two context lengths) are not pinned down,
    and non-negative least squares then picks any of the fits, some absurd away from the shapes seen: from a 2-core
    CPU's stored profile of 7 shapes, 856 ms for 5 tokens over 1,000 positions where the four terms said 167. The
    verify and row-span terms are for costs that need them (a GPU's first draft column, H100's table in
    tests/unit/test_step_cost.py), and such costs show as a lower held-out error once there are shapes enough."""
    if len(y) < ALL_TERMS_MIN_SHAPES:
        return BASE_TERMS
    base = held_out_error(x, y, BASE_TERMS)
    if base < BASE_GOOD_ENOUGH:  # nothing left to explain (and exact data would fit all seven as well, anyhow)
        return BASE_TERMS
    return ALL_TERMS if held_out_error(x, y, ALL_TERMS) <= ALL_TERMS_ERROR_SHARE * base else BASE_TERMS


def held_out_error(x: np.ndarray, y: np.ndarray, terms: tuple[int, ...]) -> float:
    """The median relative error of predictions for shapes left out of the fit (CROSS_VALIDATION_FOLDS folds, shape
    i in fold i mod folds: deterministic)."""
    folds = np.arange(len(y)) % CROSS_VALIDATION_FOLDS
    errors = []
    for fold in range(CROSS_VALIDATION_FOLDS):
        out = folds == fold
        coefficients = non_negative_least_squares(x[~out][:, terms], y[~out])
        errors.extend(np.abs(x[out][:, terms] @ coefficients - y[out]) / np.maximum(y[out], 1e-9))
    return float(np.median(errors))


def profile_shapes(max_rows: int, max_width: int) -> list[tuple[int, int]]:
    """(rows, width) pairs that pin down the coefficients: one, a few and many rows, each narrow and wide (at two
    context lengths, profile_step_cost's; the steps served add the rest)."""
    rows = sorted({1, max(1, max_rows // 2), max_rows})
    widths = sorted({1, min(2, max_width), max_width})
    return [(r, w) for r in rows for w in widths]


def profile_step_cost(
    runner: ModelRunner,
    model: StepCostModel,
    max_rows: int,
    max_width: int,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Time padded decode forwards of a few shapes on the runner's own slots (taken and given back) at two
    context lengths, into `model`. Runs on the compute thread before the engine serves; uses only free slots."""
    rows = min(max_rows, runner.num_free_slots())
    context = min(PROFILE_CONTEXT, runner.max_model_len - 1 - max_width)
    if rows < 1 or context < 2:
        logger.info("step-cost profile skipped (no free slot or no room); the engine learns costs while serving")
        return
    synchronize = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    ids = [f"{PROFILE_SEQUENCE_PREFIX}{i}" for i in range(rows)]
    vocab = runner.vocab_size
    for seq_id in ids:
        runner.add_sequence(seq_id)
    started_profile = clock()

    def out_of_time() -> bool:
        return len(model.samples()) >= MIN_SHAPES and clock() - started_profile > PROFILE_BUDGET_S

    try:
        for length in sorted({max(1, context // 4), context}):
            if out_of_time():
                break
            for seq_id in ids:
                runner.truncate(seq_id, 0)
                runner.forward([RowInput(seq_id, [(7 * i + 1) % vocab for i in range(length)], 1)])
            for num_rows, width in profile_shapes(rows, max_width):
                if out_of_time():
                    logger.info("step-cost profile cut at %.1f s (the rest is learned while serving)",
                                clock() - started_profile)
                    break
                batch = [RowInput(s, [(3 + i) % vocab for i in range(width)], width) for s in ids[:num_rows]]
                for repeat in range(PROFILE_REPEATS + 1):
                    started = clock()
                    runner.forward(batch)
                    synchronize()
                    seconds = clock() - started
                    for seq_id in ids[:num_rows]:
                        runner.truncate(seq_id, length)
                    if repeat:  # the first run of a shape warms its kernels
                        model.observe(StepShape(num_rows, width, length + width), seconds)
    finally:
        for seq_id in ids:
            runner.remove_sequence(seq_id)
    model.fit()
    logger.info("step-cost profile: %s", model.describe())

