"""The drafter method registry: built-in and plug-in methods, clear errors, and the service boundary."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from services.common import drafter_methods
from services.common.drafter_methods import (
    MethodUnavailableError,
    UnknownMethodError,
    check_method,
    method_names,
)
from services.common.proposer import DraftInput
from services.common.speculative_config import SpeculativeConfig
from services.inprocess import local_proposers
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.plugins import THROWAWAY_METHOD, install_throwaway_method
from tests.prompts import repetitive_prompt
from tests.tiny_models import tiny_llama

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # fresh interpreters that import the verifier and the gateway (torch, transformers)
def test_importing_the_verifier_or_the_gateway_loads_no_drafter_code():
    """Each service is its own process; what two share lives in services/common or services/modeling."""
    code = (
        "import sys, services.verifier.server, services.gateway.app\n"
        "print(sorted(m for m in sys.modules if m.startswith('services.drafter')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_builtin_method_has_a_module_with_build_proposer():
    assert {"ngram", "suffix"} <= set(method_names())
    for name, method in drafter_methods.BUILTIN_METHODS.items():
        assert (REPO / (method.module.replace(".", "/") + ".py")).is_file(), name


def test_an_unknown_method_is_refused_with_the_choices():
    with pytest.raises(UnknownMethodError, match=r"unknown speculative method 'medusa'; available: .*ngram.*'none'"):
        check_method("medusa")
    assert check_method("none") == "none"
    with pytest.raises(UnknownMethodError, match="turns speculation off"):
        drafter_methods.load_method("none")


@pytest.fixture
def throwaway_plugin(tmp_path, monkeypatch):
    """The throwaway method installed as a package would be: its entry point is found, nothing else changes."""
    folder = install_throwaway_method(tmp_path)
    monkeypatch.syspath_prepend(str(folder))
    drafter_methods._plugin_methods.cache_clear()
    yield THROWAWAY_METHOD
    drafter_methods._plugin_methods.cache_clear()


def test_a_plugin_method_is_registered_by_its_entry_point_alone(throwaway_plugin):
    assert throwaway_plugin in method_names()
    config = SpeculativeConfig(method=throwaway_plugin, num_speculative_tokens=4)
    assert local_proposers(config)[throwaway_plugin].method == throwaway_plugin


async def test_a_plugin_method_brings_its_own_options(throwaway_plugin):
    """The config checks a plug-in's fields against the OPTIONS its module declares, and its proposer gets them."""
    config = SpeculativeConfig.parse(f'{{"method": "{throwaway_plugin}", "throwaway_max_draft": 2}}')
    assert config.options.throwaway_max_draft == 2
    proposer = local_proposers(config)[throwaway_plugin]
    (draft,) = await proposer.propose([DraftInput("s", [1, 2, 3, 1, 2, 3, 1], 6)])
    assert list(draft.token_ids) == [2, 3]  # 6 asked, 2 by its option
    with pytest.raises(ValueError, match=r"throwaway_max_draft: Input should be greater than or equal to 1"):
        SpeculativeConfig.parse(f'{{"method": "{throwaway_plugin}", "throwaway_max_draft": 0}}')
    with pytest.raises(ValueError, match=r"prompt_lookup_max: not an option of method 'throwaway' "
                                         r"\(its options: throwaway_max_draft\)"):
        SpeculativeConfig.parse(f'{{"method": "{throwaway_plugin}", "prompt_lookup_max": 3}}')


def test_a_plugin_cannot_take_over_a_builtin_name(tmp_path, monkeypatch):
    dist_info = tmp_path / "evil-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[{drafter_methods.ENTRY_POINT_GROUP}]\nngram = evil_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    drafter_methods._plugin_methods.cache_clear()
    try:
        assert drafter_methods.method_modules()["ngram"] == "services.drafter.methods.ngram"
    finally:
        drafter_methods._plugin_methods.cache_clear()


async def test_greedy_output_is_identical_with_a_plugin_method(throwaway_plugin):
    """Lossless for any registered method: the plug-in's drafts change the speed, never the tokens."""
    proposers = local_proposers(SpeculativeConfig(method=throwaway_plugin, num_speculative_tokens=4))
    runner = LlamaFamilyRunner(tiny_llama(), max_num_seqs=2, max_model_len=160)
    engine = Engine(runner, EngineConfig(log_stats_interval_s=0), proposers, eos_token_ids=())
    prompt = repetitive_prompt(random.Random(3), 48)
    requests = {
        0: [GenerationRequest("on", prompt, SamplingParams(max_tokens=40, temperature=0.0),
                              SpeculationParams(throwaway_plugin, 4)),
            GenerationRequest("off", prompt, SamplingParams(max_tokens=40, temperature=0.0), SpeculationParams())]
    }
    results = await run_schedule(engine, requests)
    assert results["on"].tokens == results["off"].tokens
    assert results["on"].outputs[-1].spec.num_drafts > 0


def test_a_method_that_cannot_run_here_fails_with_its_own_message(monkeypatch, tmp_path):
    (tmp_path / "unavailable_method.py").write_text(
        "from services.common.drafter_methods import MethodUnavailableError\n"
        "def build_proposer(config):\n"
        "    raise MethodUnavailableError('needs libfoo; pip install foo')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(drafter_methods, "method_modules", lambda: {"unavailable": "unavailable_method"})
    with pytest.raises(MethodUnavailableError, match="needs libfoo"):
        drafter_methods.build_proposer(SpeculativeConfig.model_construct(method="unavailable"))
