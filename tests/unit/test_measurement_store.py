"""Start-up measurements kept for the next start (measurement_store.py): a second start with the same identity
runs no profile forward and plans with the same costs, and places its forwards without timing them; another
identity, an old, corrupt or foreign file, or an unwritable folder means measuring again."""

from __future__ import annotations

import json
import logging
import time

import torch

from services.common.main_thread_compute import worker_thread
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier import server
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.measurement_store import MAX_AGE_S, MeasurementStore, setup_identity
from services.verifier.settings import VerifierSettings
from services.verifier.step_cost import StepShape
from services.verifier.step_cost_cache import StepCostCache
from tests.tiny_models import tiny_llama


class CountingRunner:
    """The runner, counting forwards (the profile is the only thing that runs any before a request)."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.forwards = 0

    def forward(self, rows):
        self.forwards += 1
        return self._runner.forward(rows)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def setup(model_config="{}") -> dict:
    return setup_identity("tiny-llama", model_config, "torch.float32", torch.device("cpu"))


def cache_in(directory, model_config="{}", compute_thread="worker") -> StepCostCache:
    return StepCostCache(MeasurementStore(directory), setup(model_config), compute_thread)


async def started_engine(model, cache, max_num_seqs=4) -> tuple[Engine, CountingRunner]:
    runner = CountingRunner(LlamaFamilyRunner(model, max_num_seqs=max_num_seqs, max_model_len=160))
    engine = Engine(runner, EngineConfig(log_stats_interval_s=0, step_cost_cache=cache))
    await engine.start()
    await engine.shutdown()
    return engine, runner


SHAPES = [StepShape(1, 1, 40), StepShape(4, 9, 137), StepShape(2, 5, 300)]


async def test_a_second_start_reuses_the_profile_without_a_forward(tmp_path):
    model = tiny_llama(seed=1)
    first, first_runner = await started_engine(model, cache_in(tmp_path))
    assert first_runner.forwards > 10 and first.planner.cost.fitted
    assert len(list(tmp_path.glob("step-cost-*.json"))) == 1

    second, second_runner = await started_engine(model, cache_in(tmp_path))
    assert second_runner.forwards == 0
    assert [second.planner.cost.predict(s) for s in SHAPES] == [first.planner.cost.predict(s) for s in SHAPES]


async def test_another_identity_measures_again(tmp_path):
    model = tiny_llama(seed=1)
    await started_engine(model, cache_in(tmp_path))
    _, other_config = await started_engine(model, cache_in(tmp_path, model_config='{"hidden_size": 2}'))
    _, other_slots = await started_engine(model, cache_in(tmp_path), max_num_seqs=2)
    _, other_thread = await started_engine(model, cache_in(tmp_path, compute_thread="main"))
    assert other_config.forwards > 10 and other_slots.forwards > 10 and other_thread.forwards > 10
    assert len(list(tmp_path.glob("step-cost-*.json"))) == 4


async def test_an_old_corrupt_or_foreign_file_is_measured_over(tmp_path, caplog):
    model = tiny_llama(seed=1)
    await started_engine(model, cache_in(tmp_path))
    (path,) = tmp_path.glob("step-cost-*.json")
    stored = json.loads(path.read_text())

    path.write_text(json.dumps({**stored, "measured_at": time.time() - MAX_AGE_S - 60}))
    _, runner = await started_engine(model, cache_in(tmp_path))
    assert runner.forwards > 10
    assert json.loads(path.read_text())["measured_at"] > time.time() - 60  # measured again, stored again

    path.write_text(json.dumps({**stored, "identity": {**stored["identity"], "hardware": "another CPU"}}))
    _, runner = await started_engine(model, cache_in(tmp_path))
    assert runner.forwards > 10

    for corrupt in ('{"identity": ', json.dumps({**stored, "result": [{"rows": "many"}]})):
        path.write_text(corrupt)
        with caplog.at_level(logging.WARNING):
            _, runner = await started_engine(model, cache_in(tmp_path))
        assert runner.forwards > 10
    assert "ignoring the stored step-cost" in caplog.text


async def test_an_unwritable_folder_costs_a_warning_not_the_start(tmp_path, caplog):
    blocker = tmp_path / "a-file"  # a folder under a file cannot be made, even by root (unlike a read-only one)
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        engine, runner = await started_engine(tiny_llama(seed=1), cache_in(blocker / "measurements"))
    assert runner.forwards > 10 and engine.planner.cost.fitted
    assert "could not store the step-cost measurement" in caplog.text
    assert list(tmp_path.iterdir()) == [blocker]


def test_the_forwards_thread_is_measured_once_per_setup(tmp_path, monkeypatch):
    runner = LlamaFamilyRunner(tiny_llama(seed=1), max_num_seqs=2, max_model_len=300)
    store, settings, worker = MeasurementStore(tmp_path), VerifierSettings(), worker_thread()
    try:
        measured = server.place_forwards(settings, runner, worker, store, setup())
        assert measured in ("main", "worker") and len(list(tmp_path.glob("placement-*.json"))) == 1

        def no_measuring(*args):
            raise AssertionError("measured again")

        monkeypatch.setattr(server, "choose_compute_thread", no_measuring)
        assert server.place_forwards(settings, runner, worker, store, setup()) == measured
        monkeypatch.undo()
        other = server.place_forwards(settings, runner, worker, store, setup('{"other": 1}'))
        assert other in ("main", "worker") and len(list(tmp_path.glob("placement-*.json"))) == 2
    finally:
        worker.shutdown(wait=True)
