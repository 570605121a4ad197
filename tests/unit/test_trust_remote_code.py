"""vLLM's --trust-remote-code: a model folder that ships Python code for its architecture and tokenizer (auto_map in
its config.json and tokenizer_config.json) loads only with the flag, in the verifier's loader, in `generate`'s
local engine and in the gateway's tokenizer; without it the load fails naming the flag, not with a traceback."""

from __future__ import annotations

import json

import pytest
import torch

from services.gateway.tokenizer import load_tokenizer
from services.inprocess import LocalEngineOptions, build_local_engine
from services.modeling.loading import load_model
from services.modeling.model_source import ModelUnavailableError
from tests.tiny_models import tiny_llama, word_tokenizer

CONFIGURATION = '''from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tinyremote"
'''
MODELING = '''from transformers import LlamaForCausalLM

from .configuration_tinyremote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
'''
TOKENIZATION = '''from transformers import PreTrainedTokenizerFast


class TinyRemoteTokenizer(PreTrainedTokenizerFast):
    pass
'''


def _merge_json(path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.fixture(scope="module")
def remote_code_folder(tmp_path_factory):
    """tiny_llama's weights and a word tokenizer, under an architecture and a tokenizer class of the folder's own
    code (as a hub repo with custom code has them)."""
    folder = tmp_path_factory.mktemp("remote-code")
    (folder / "configuration_tinyremote.py").write_text(CONFIGURATION)
    (folder / "modeling_tinyremote.py").write_text(MODELING)
    (folder / "tokenization_tinyremote.py").write_text(TOKENIZATION)
    model = tiny_llama()
    model.save_pretrained(folder)
    word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    _merge_json(folder / "config.json", model_type="tinyremote", architectures=["TinyRemoteForCausalLM"],
                auto_map={"AutoConfig": "configuration_tinyremote.TinyRemoteConfig",
                          "AutoModelForCausalLM": "modeling_tinyremote.TinyRemoteForCausalLM"})
    _merge_json(folder / "tokenizer_config.json", tokenizer_class="TinyRemoteTokenizer",
                auto_map={"AutoTokenizer": [None, "tokenization_tinyremote.TinyRemoteTokenizer"]})
    return folder


def test_the_model_loads_with_its_own_code_only_when_trusted(remote_code_folder):
    with pytest.raises(ModelUnavailableError, match="--trust-remote-code"):
        load_model(str(remote_code_folder), device="cpu")
    loaded = load_model(str(remote_code_folder), device="cpu", trust_remote_code=True)
    assert type(loaded.model).__name__ == "TinyRemoteForCausalLM"
    assert type(loaded.tokenizer).__name__ == "TinyRemoteTokenizer"
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded.model(ids).logits, tiny_llama()(ids).logits)  # the folder's weights


def test_the_gateways_tokenizer_loads_with_its_own_code_only_when_trusted(remote_code_folder):
    with pytest.raises(ModelUnavailableError, match="--trust-remote-code"):
        load_tokenizer(str(remote_code_folder))
    tokenizer = load_tokenizer(str(remote_code_folder), trust_remote_code=True)
    assert type(tokenizer).__name__ == "TinyRemoteTokenizer"
    assert tokenizer.decode(tokenizer.encode("w5 w6")) == "w5 w6"


def test_generates_local_engine_takes_the_flag(remote_code_folder):
    with pytest.raises(ModelUnavailableError, match="--trust-remote-code"):
        build_local_engine(LocalEngineOptions(model=str(remote_code_folder), device="cpu"))
    _, loaded = build_local_engine(LocalEngineOptions(model=str(remote_code_folder), device="cpu",
                                                      trust_remote_code=True, kv_cache_memory_bytes="16MiB"))
    assert type(loaded.model).__name__ == "TinyRemoteForCausalLM"
