"""The step-cost model against a real accelerator's costs: the device time of one replayed step graph by rows,
width and span, measured on an NVIDIA H100 80GB (torch 2.11, bf16, SmolLM2-135M-Instruct; `python -m
services.bench.step_host_profile --only-device`, stop 49). There a step of 2 to 9 tokens a row costs about the same,
and more than a step of 1 token, by an amount that grows with the span: the model has to see that first column's
price, or the planner takes a one-token draft for free."""

from __future__ import annotations

import statistics

from services.modeling.step_graphs import WIDTH_BUCKETS, width_bucket
from services.verifier.speculation_planner import best_width
from services.verifier.step_cost import StepCostModel, StepShape

SPANS = (256, 512, 1024, 2048, 4096)
H100_MS = {  # (rows, width): ms at each of SPANS
    (1, 1): (1.813, 1.840, 1.866, 2.000, 2.248), (1, 2): (2.070, 2.204, 2.483, 3.014, 4.097),
    (1, 3): (2.097, 2.231, 2.515, 3.054, 4.145), (1, 5): (2.101, 2.244, 2.507, 3.068, 4.154),
    (1, 9): (2.092, 2.251, 2.528, 3.107, 4.135), (8, 1): (2.184, 2.428, 2.890, 3.827, 5.720),
    (8, 2): (2.353, 2.687, 3.402, 4.661, 7.343), (8, 3): (2.377, 2.707, 3.368, 4.704, 7.390),
    (8, 5): (2.417, 2.753, 3.412, 4.731, 7.429), (8, 9): (2.435, 2.776, 3.425, 4.755, 7.457),
    (64, 1): (3.862, 5.763, 9.698, 17.415, 32.653), (64, 2): (4.652, 7.002, 11.626, 20.863, 39.382),
    (64, 3): (4.684, 7.043, 11.668, 20.916, 39.430), (64, 5): (4.787, 7.138, 11.761, 21.011, 39.528),
    (64, 9): (5.069, 7.393, 12.017, 21.256, 39.748),
}


def fitted(costs_ms: dict[tuple[int, int], tuple[float, ...]], padding=None) -> StepCostModel:
    model = StepCostModel(padding)
    for (rows, width), row in costs_ms.items():
        for span, ms in zip(SPANS, row, strict=True):
            model.observe(StepShape(rows, width, span + width), ms / 1000)
    model.fit()
    return model


def test_the_model_fits_an_accelerator_whose_first_draft_column_costs_most():
    model = fitted(H100_MS)
    errors = [abs(model.predict(StepShape(rows, width, span + width)) * 1000 - ms) / ms
              for (rows, width), row in H100_MS.items() for span, ms in zip(SPANS, row, strict=True)]
    assert statistics.median(errors) < 0.08 and max(errors) < 0.35
    for rows in (1, 8, 64):  # the first draft column's price: measured 1.20x, 1.11x and 1.21x at 512 positions
        ratio = model.predict(StepShape(rows, 2, 514)) / model.predict(StepShape(rows, 1, 513))
        measured = H100_MS[(rows, 2)][1] / H100_MS[(rows, 1)][1]
        assert abs(ratio - measured) < 0.2 and ratio > 1.08
    # and so one request's poor drafts (15% acceptance) are not worth their column; good ones (60%) are
    assert best_width([[0.15, 0.02, 0.0, 0.0]], 512, model) == 1
    assert best_width([[0.6, 0.4, 0.25, 0.15]], 512, model) > 1


def test_widths_one_graph_pads_alike_cost_alike_and_the_planner_fills_them():
    """Where the runner pads a row's width up to its graph's bucket (its padded_shape), the model prices a width by
    its bucket: a draft of 5 tokens costs what one of 8 does, so the planner never pays for columns it leaves
    empty. At every acceptance rate and load the width it takes is a whole bucket."""
    model = fitted(H100_MS, padding=lambda rows, width, span: (rows, width_bucket(width), span))
    assert model.predict(StepShape(1, 6, 520)) == model.predict(StepShape(1, 9, 520))
    assert model.predict(StepShape(8, 4, 520)) == model.predict(StepShape(8, 5, 520))
    assert model.predict(StepShape(8, 4, 520)) > model.predict(StepShape(8, 3, 520))
    chosen = {best_width([[rate**j for j in range(1, 9)]] * rows, 512, model)
              for rows in (1, 8, 64) for rate in (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)}
    assert chosen <= set(WIDTH_BUCKETS) and len(chosen) > 2, chosen


def test_every_widths_prediction_at_once_is_each_width_predicted_alone():
    for padding in (None, lambda rows, width, span: (rows, width_bucket(width), span)):
        model = fitted(H100_MS, padding=padding)
        for rows, span in ((1, 100), (7, 517), (64, 3000)):
            alone = [model.predict(StepShape(rows, width, span + width)) for width in range(1, 10)]
            assert model.predict_widths(rows, span, 9) == alone  # the same floats, not approximately
    assert StepCostModel().predict_widths(4, 100, 3) == [0.0, 0.0, 0.0]  # not fitted yet


def test_a_cost_linear_in_the_tokens_is_still_fitted_exactly():
    """The CPU's shape (SmolLM2 on 2 cores: weights read once per forward, then per row and per token)."""
    cpu_ms = {(rows, width): tuple(16 + rows + 0.9 * rows * width + 0.002 * rows * width * span for span in SPANS)
              for rows in (1, 4, 8, 16) for width in (1, 2, 5, 9)}
    model = fitted(cpu_ms)
    for (rows, width), row in cpu_ms.items():
        for span, ms in zip(SPANS, row, strict=True):
            predicted = model.predict(StepShape(rows, width, span + width)) * 1000
            assert abs(predicted - ms) / ms < 0.02


def test_a_start_up_profile_of_a_few_shapes_fits_the_four_base_terms_only():
    """Seven coefficients from 7 shapes at one context length are not pinned down, and non-negative least squares
    then picks a fit that is absurd away from them; the verify and row-span terms wait until shapes left out of the
    fit show they predict better. The shapes: a stored start-up profile of SmolLM2 on this 2-core EPYC (one thread,
    a busy machine: 4 rows of 2 tokens took longer than of 1 here), median ms at 33-41 positions."""
    profile_ms = {(1, 1, 33): 105.6, (1, 2, 34): 155.8, (1, 9, 41): 227.1, (4, 1, 33): 169.2, (4, 2, 34): 235.4,
                  (4, 9, 41): 408.6, (8, 1, 33): 266.9}
    model = StepCostModel()
    for (rows, width, span), ms in profile_ms.items():
        model.observe(StepShape(rows, width, span), ms / 1000)
    model.fit()
    assert model.fitted and "more than one token a row" not in model.describe()
    for rows in (1, 4):  # at 1,000 positions, which the profile never saw: not several times what it saw at 45
        near, far = (model.predict(StepShape(rows, 5, span)) for span in (45, 1005))
        assert far < 2 * near
    assert "more than one token a row" in fitted(H100_MS).describe()  # a GPU's table earns the other terms
    # and so do the 18 shapes of a start-up profile there (1, 8 and 64 rows of 1, 2 and 9 tokens, two contexts)
    profile = StepCostModel()
    for (rows, width), row in H100_MS.items():
        for span, ms in zip(SPANS[:2], row[:2], strict=True):
            if width in (1, 2, 9):
                profile.observe(StepShape(rows, width, span + width), ms / 1000)
    profile.fit()
    assert profile.predict(StepShape(1, 2, 514)) > 1.08 * profile.predict(StepShape(1, 1, 513))


def test_the_shapes_most_steps_run_weigh_most_in_the_fit():
    """A batch of 64 that drains and refills passes through many shapes once each (39-63 rows, each at its own
    context), slower a row than the few shapes at 64 rows that most of its steps run (engine_host_cost's chat text
    on a simulated H200 step: 6.5-7.5 ms at 39-63 rows, 5.5 at 64). The fit has to be right where the steps are."""
    model = StepCostModel()
    for rows in range(39, 64):
        model.observe(StepShape(rows, 1, 140 + 60 * (rows % 3)), 0.007)
    for _ in range(100):
        for span in (140, 200, 260):
            model.observe(StepShape(64, 1, span), 0.0055)
    model.fit()
    for span in (140, 200, 260):
        assert abs(model.predict(StepShape(64, 1, span)) - 0.0055) < 0.05 * 0.0055


def test_a_refit_reads_every_shapes_current_median_and_weight_as_a_fit_from_scratch_would():
    """The fit keeps each shape's features, median and weight between fits and works out again only the medians of
    shapes observed since: its coefficients must be those of a fit built from all the samples at once."""
    import random
    import statistics

    import numpy as np

    from services.verifier.step_cost import ALL_TERMS, REFIT_EVERY, WEIGHT_HALF_LIFE, non_negative_least_squares

    rng = random.Random(3)
    model = StepCostModel()
    history: dict[tuple[int, int, int], list[tuple[int, float]]] = {}  # key -> (observation index, seconds)
    for n in range(40 * REFIT_EVERY + 5):
        shape = StepShape(rng.choice([1, 2, 8, 64]), rng.choice([1, 1, 2, 5]), rng.randrange(64, 2048))
        seconds = 0.002 + 3e-5 * shape.rows + 1e-4 * shape.tokens + rng.random() * 1e-4
        model.observe(shape, seconds)
        history.setdefault((shape.rows, shape.width, shape.span // 64), []).append((n, seconds))
    model.fit()
    keys = list(history)
    x = np.array([model._shapes[key].features() for key in keys])
    y = np.array([statistics.median([s for _, s in history[key][-9:]]) for key in keys])

    def weight(seen: list[tuple[int, float]]) -> float:
        count, last = 0.0, 0
        for at, _ in seen:
            count = count * 0.5 ** ((at - last) / WEIGHT_HALF_LIFE) + 1.0
            last = at
        return count * 0.5 ** ((model.num_observations - last) / WEIGHT_HALF_LIFE)

    expected = np.zeros(len(ALL_TERMS))
    terms = list(model._terms)
    expected[terms] = non_negative_least_squares(x[:, terms], y, np.array([weight(history[key]) for key in keys]))
    assert np.allclose(model._coefficients, expected, rtol=1e-9, atol=1e-15)
