"""extract_hidden_states: each finished request leaves a safetensors file with its token ids and the target's
final hidden states ([tokens - 1, layers, hidden]), equal to transformers' own, with speculation on or off; the
output itself is unchanged; request ids cannot escape the folder."""

from __future__ import annotations

import torch
from safetensors import safe_open

from services.drafter.methods.ngram import NgramProposer
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.hidden_state_files import file_for
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.tiny_models import tiny_llama


async def test_files_hold_the_token_ids_and_the_targets_states(tmp_path):
    model = tiny_llama(seed=5)
    prompts = {"plain": list(range(3, 40)), "spec/../x": [4, 5, 6, 4, 5, 6, 4, 5]}
    engine = Engine(LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=128),
                    EngineConfig(max_num_batched_tokens=16, log_stats_interval_s=0, adaptive_speculation=False,
                                 extract_hidden_states_dir=tmp_path),
                    {"ngram": NgramProposer()})
    requests = [GenerationRequest("plain", tuple(prompts["plain"]), SamplingParams(max_tokens=12, temperature=0.0)),
                GenerationRequest("spec/../x", tuple(prompts["spec/../x"]),
                                  SamplingParams(max_tokens=12, temperature=0.0), SpeculationParams("ngram", 3))]
    results = await run_schedule(engine, {0: requests})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.safetensors", "spec_.._x.safetensors"]
    assert file_for(tmp_path, "../../etc/passwd").parent == tmp_path
    for rid, prompt in prompts.items():
        tokens = prompt + results[rid].tokens
        with safe_open(str(file_for(tmp_path, rid)), "pt") as f:
            ids, states = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
            assert f.metadata()["num_prompt_tokens"] == str(len(prompt)) and f.metadata()["layers"] == "[-1]"
        assert ids.tolist() == tokens
        assert states.dtype == torch.float16 and states.shape == (len(tokens) - 1, 1, 64)
        with torch.no_grad():
            truth = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        assert torch.allclose(states[:, 0].float(), truth[:-1], atol=2e-2, rtol=1e-2)


def test_the_speculative_config_names_it_as_vllm_does(tmp_path):
    import argparse
    import json

    import pytest

    from services import launcher
    from services.common.speculative_config import SpeculativeConfig
    from services.verifier.server import extract_dir
    from services.verifier.settings import VerifierSettings

    spec = json.dumps({"method": "extract_hidden_states", "output_dir": str(tmp_path / "states")})
    config = SpeculativeConfig.parse(spec)
    assert not config.enabled and config.extract_dir == str(tmp_path / "states")
    with pytest.raises(ValueError, match="output_dir"):
        SpeculativeConfig.parse('{"method": "extract_hidden_states"}')
    assert extract_dir(VerifierSettings(speculative_config=spec)) == tmp_path / "states"
    assert (tmp_path / "states").is_dir()
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    children = launcher.plan(parser.parse_args(["--speculative-config", spec]))
    assert [c.name for c in children] == ["verifier", "gateway"]  # no drafter: nothing drafts
    verifier = children[0].argv
    assert json.loads(verifier[verifier.index("--speculative-config") + 1])["method"] == "extract_hidden_states"
