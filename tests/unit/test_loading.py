"""`--model` resolution and loading: folders, .gguf files, registered names and hub ids.

Folder tests save a tiny random llama (safetensors) plus a real `tokenizers` tokenizer and check that the
loaded weights are the saved ones, not a fresh random init. Hub tests point the endpoint at a closed local
port so "the hub is unreachable" is deterministic, and must fail in seconds. The slow tests load SmolLM2.
"""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hf_constants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from services.modeling import loading, model_source
from services.modeling.loading import hub_reachable, load_model
from services.modeling.model_source import ModelSource, ModelUnavailableError, resolve_model_source
from services.modeling.registry import REGISTERED_MODELS, registered_model_names

WORDS = ["[UNK]", "<s>", "</s>", "hello", "world", "the", "cat", "sat"]
CLOSED_ENDPOINT = "http://127.0.0.1:9"  # discard port; nothing listens there on a test machine


def save_tiny_llama(folder: Path) -> LlamaForCausalLM:
    """A 2-layer llama with GQA and a word-level tokenizer: enough to exercise the real loading path."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    return folder, save_tiny_llama(folder)


@pytest.fixture
def hub_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreachable hub, whatever this machine's network is like; offline mode off, so code must probe."""
    monkeypatch.setattr(hf_constants, "ENDPOINT", CLOSED_ENDPOINT)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# ----------------------------------------------------------------------------------------------- resolving


def test_folder_source(tiny) -> None:
    folder, _ = tiny
    assert resolve_model_source(str(folder)) == ModelSource("folder", str(folder.resolve()), "tiny-llama")


def test_gguf_file_and_gguf_only_folder(tmp_path: Path) -> None:
    file = tmp_path / "m" / "Some.Q4.gguf"
    file.parent.mkdir()
    file.write_bytes(b"GGUF")
    expected = ModelSource("gguf", str(file.parent.resolve()), "Some.Q4.gguf", gguf_file="Some.Q4.gguf")
    assert resolve_model_source(str(file)) == expected
    assert resolve_model_source(str(file.parent)) == expected  # a folder holding just one .gguf


def test_other_files_and_missing_paths_are_rejected(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_source(str(weights))
    for missing in [str(tmp_path / "nope"), "./nope", "nope.gguf"]:
        with pytest.raises(ModelUnavailableError, match="smollm2-135m-instruct"):
            resolve_model_source(missing)


def test_registered_names_resolve_case_insensitively(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched: list[str] = []

    def fake_fetch(model, cache_dir):  # stands in for the network
        fetched.append(model.name)
        return Path(cache_dir) / model.name / model.filename

    monkeypatch.setattr(model_source, "fetch_registered_model", fake_fetch)
    model = REGISTERED_MODELS["qwen2.5-coder-0.5b-instruct"]
    source = resolve_model_source("Qwen2.5-Coder-0.5B-Instruct", tmp_path)
    assert source == ModelSource(
        "registered", str(tmp_path / model.name), model.name, gguf_file=model.filename
    )
    assert fetched == [model.name]
    assert resolve_model_source("smollm2-135m-instruct", tmp_path, fetch=False).kind == "registered"
    assert fetched == [model.name]


def test_anything_else_is_a_hub_id() -> None:
    assert resolve_model_source("HuggingFaceTB/SmolLM2-360M") == ModelSource(
        "hub", "HuggingFaceTB/SmolLM2-360M", "HuggingFaceTB/SmolLM2-360M"
    )


# ------------------------------------------------------------------------------------------------- folders


def test_load_folder_keeps_saved_weights(tiny) -> None:
    folder, original = tiny
    loaded = load_model(str(folder), device="cpu")
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert not loaded.model.training
    assert loaded.model_id == "tiny-llama" and loaded.source.kind == "folder"
    assert loaded.device == torch.device("cpu") and loaded.dtype is torch.float32
    assert next(loaded.model.parameters()).dtype is torch.float32
    torch.testing.assert_close(logits(loaded.model), logits(original), rtol=0, atol=0)
    ids = loaded.tokenizer("hello world")["input_ids"]
    assert ids == [3, 4]
    assert loaded.tokenizer.decode(ids) == "hello world"
    assert loaded.load_seconds > 0


def test_load_folder_in_bfloat16(tiny) -> None:
    folder, original = tiny
    loaded = load_model(str(folder), device="cpu", dtype="bf16")
    assert loaded.dtype is torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(logits(loaded.model), logits(original), rtol=0.1, atol=0.1)


def test_pickled_weights_need_opt_in(tiny, tmp_path: Path) -> None:
    folder, original = tiny
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(folder / name, pickled / name)
    torch.save(original.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickled weights \(pytorch_model\.bin\).*allow_pickle=True"):
        load_model(str(pickled))
    loaded = load_model(str(pickled), allow_pickle=True)
    torch.testing.assert_close(logits(loaded.model), logits(original), rtol=0, atol=0)


def test_folder_without_weights(tmp_path: Path, tiny) -> None:
    folder, _ = tiny
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no model weights"):
        load_model(str(tmp_path))


def test_bad_device_fails_before_loading(tiny) -> None:
    folder, _ = tiny
    with pytest.raises(ValueError, match="unknown device"):
        load_model(str(folder), device="gpu")


# ----------------------------------------------------------------------------------------------------- hub


def test_unreachable_hub_fails_fast_with_registered_names(hub_down: None) -> None:
    started = time.monotonic()
    with pytest.raises(ModelUnavailableError) as info:
        load_model("someorg/definitely-not-cached-model")
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "'someorg/definitely-not-cached-model'" in message
    assert "not reachable" in message and CLOSED_ENDPOINT in message
    for name in registered_model_names():
        assert name in message


def test_offline_mode_skips_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(loading, "hub_reachable", lambda *a, **k: pytest.fail("probed in offline mode"))
    with pytest.raises(ModelUnavailableError, match="HF_HUB_OFFLINE"):
        load_model("someorg/definitely-not-cached-model")


def test_hub_id_found_in_local_hf_cache(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub_down: None
) -> None:
    """A model already in the HF cache loads with no network at all (the probe is never needed)."""
    folder, original = tiny
    repo = tmp_path / "models--someorg--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "hub_reachable", lambda *a, **k: pytest.fail("probed with a cached model"))
    loaded = load_model("someorg/tiny-llama")
    assert loaded.source.kind == "hub" and loaded.model_id == "someorg/tiny-llama"
    torch.testing.assert_close(logits(loaded.model), logits(original), rtol=0, atol=0)


def test_reachable_hub_is_used_after_cache_miss(monkeypatch: pytest.MonkeyPatch, tiny) -> None:
    """Only the decision is tested here (no real hub): cache first, then one normal load."""
    _, original = tiny
    calls: list[dict] = []

    def fake_from_pretrained(source, dtype, trust_remote_code, **extra):
        calls.append(extra)
        if extra.get("local_files_only"):
            raise OSError("not cached")
        return original, None

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading, "_from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(loading, "hub_reachable", lambda *a, **k: True)
    loaded = load_model("someorg/tiny-llama")
    assert loaded.model is original
    assert calls == [{"local_files_only": True, "use_safetensors": True}, {"use_safetensors": True}]


def test_hub_reachable_probe() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert hub_reachable(f"http://127.0.0.1:{port}")
    assert not hub_reachable(f"http://127.0.0.1:{port}")  # now closed
    started = time.monotonic()
    assert not hub_reachable("https://no-such-host.invalid")
    assert not hub_reachable("not a url")
    assert time.monotonic() - started < 8


def test_hub_probe_goes_through_a_configured_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        assert hub_reachable("https://no-such-host.invalid")


# ---------------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.mark.slow
def test_smollm2_loads_from_gguf(smollm2) -> None:
    assert smollm2.source.kind == "registered" and smollm2.source.gguf_file.endswith(".gguf")
    config = smollm2.model.config
    assert config.model_type == "llama" and config.vocab_size == 49152
    assert isinstance(smollm2.model.model.layers[0].mlp.up_proj, torch.nn.Linear)  # dense, not packed
    assert smollm2.model.model.layers[0].mlp.up_proj.weight.dtype is torch.float32
    ids = smollm2.tokenizer("Hello world")["input_ids"]
    assert smollm2.tokenizer.decode(ids) == "Hello world"


@pytest.mark.slow
def test_smollm2_greedy_answer(smollm2) -> None:
    tok = smollm2.tokenizer
    prompt = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        out = smollm2.model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt.shape[1] :])
