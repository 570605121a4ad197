"""The step profile splits a real engine step into parts that add up to it."""

from __future__ import annotations

import pytest

from services.bench.step_profile import profile_runner
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier import step_execution
from tests.tiny_models import tiny_llama


async def test_the_parts_of_a_step_add_up_and_the_engine_is_left_unwrapped():
    runner = LlamaFamilyRunner(tiny_llama(), max_num_seqs=1, max_model_len=128)
    original = step_execution.execute
    runs = await profile_runner(runner, list(range(1, 20)), max_tokens=12, repeats=2)
    assert step_execution.execute is original
    for run in runs:
        assert set(run) == {"step", "forward", "other tensor work", "loop side"}
        assert run["forward"] > 0 and run["other tensor work"] > 0 and run["loop side"] > 0
        assert run["forward"] + run["other tensor work"] + run["loop side"] == pytest.approx(run["step"])
