"""The start-up step-cost profile: every shape at two context lengths when there is time; once it has taken
PROFILE_BUDGET_S (a big model on a small CPU), it stops as soon as MIN_SHAPES shapes are timed; the runner's
sequences are given back either way."""

from __future__ import annotations

import itertools

from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.step_cost import MIN_SHAPES, PROFILE_BUDGET_S, StepCostModel, profile_shapes, profile_step_cost
from tests.tiny_models import tiny_llama


def profile(clock) -> tuple[StepCostModel, LlamaFamilyRunner]:
    runner = LlamaFamilyRunner(tiny_llama(), max_num_seqs=4, max_model_len=256, pack_weights=False)
    model = StepCostModel()
    profile_step_cost(runner, model, 4, 3, clock=clock)
    return model, runner


def contexts(model: StepCostModel) -> set[int]:
    return {span - width for _, width, span, _ in model.samples()}


def test_the_profile_covers_two_context_lengths_within_its_budget_and_is_cut_past_it():
    model, runner = profile(clock=itertools.count(0, 0.001).__next__)  # a fast machine
    assert len(contexts(model)) == 2 and len(model.samples()) == 2 * len(profile_shapes(4, 3))
    assert runner.num_free_slots() == 4
    model, runner = profile(clock=itertools.count(0, PROFILE_BUDGET_S / 10).__next__)  # a slow one
    assert len(contexts(model)) == 1 and len(model.samples()) == MIN_SHAPES and model.fitted
    assert runner.num_free_slots() == 4 and runner.kv_usage.used_blocks == 0
