"""Shared fixtures and the suite's tiers. The real model (SmolLM2-135M-Instruct) is fetched once into the user
cache and loaded once per test process.

Tiers (markers): `e2e` is every test under tests/e2e (real processes: drafter, verifier, gateway); `slow` marks
real-model and long statistical tests wherever they are. `make test-fast` runs neither; `make test` runs all.

Parallel runs (pytest-xdist): every module is one unit of work, run whole on one worker, so a module-scoped fixture
(a loaded model, a started server) is built once. The modules in tests/e2e/stack.py's SHARED_STACK_MODULES are one
unit together: they share one session-scoped stack, started once on their worker. Units are handed out longest
first by measured time (tests/module_seconds.py), so that no long one starts last while the other worker sits
idle. Each worker and the services it starts get their share of the cores as torch threads (OMP_NUM_THREADS),
unless it is set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import module_seconds
from tests.e2e.stack import SHARED_STACK_GROUP, SHARED_STACK_MODULES

_E2E = Path(__file__).parent / "e2e"


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, torch threads per worker = cores / workers, inherited by the services a test starts: OpenMP
    pools of several processes, each as wide as the machine, spin against each other (two real-model tests side by
    side on 2 cores: 100 s with 2 threads each, 83 s with 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:  # its pool is sized on first use; set it in case that already happened
            sys.modules["torch"].set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks tests/e2e as e2e, then orders the work units longest first (tests/module_seconds.py): a unit's time
    is its modules' measured seconds, the shared-stack modules' added up; among units not measured, those with
    slow or e2e tests go first."""
    long_modules = set()
    for item in items:
        if _E2E in item.path.parents:
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("slow") or item.get_closest_marker("e2e"):
            long_modules.add(item.path)
    measured = module_seconds.load()
    root = config.rootpath
    unit_seconds: dict[str, float] = {}
    for item in items:
        module = item.path.relative_to(root).as_posix()
        unit = work_unit(module)
        unit_seconds[unit] = unit_seconds.get(unit, 0.0) + measured.pop(module, 0.0)

    def order(item: pytest.Item) -> tuple[float, bool, int]:
        module = item.path.relative_to(root).as_posix()
        in_shared = SHARED_STACK_MODULES.index(module) if module in SHARED_STACK_MODULES else 0
        return -unit_seconds[work_unit(module)], item.path not in long_modules, in_shared

    items.sort(key=order)  # stable: the order within a unit stays


def work_unit(module: str) -> str:
    """What one worker runs whole: a module, or the shared-stack modules together."""
    return SHARED_STACK_GROUP if module in SHARED_STACK_MODULES else module


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it installed, the suite runs serially
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Work units by module, the shared-stack modules as one (xdist's own `--dist loadgroup` would do this with
    marks, but it renames node ids in a way pytest 9.2 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False  # keep the order above: long modules first
    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def smollm2():
    from services.modeling.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
