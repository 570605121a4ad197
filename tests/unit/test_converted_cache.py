"""The converted folder of a registered model: made once, reused, remade when stale or incomplete, skipped when the
cache cannot be written, and (slow) holding exactly what a direct GGUF load gives: every tensor bit for bit, the
config, and the tokenizer (ids, decoding, chat template, special tokens, fingerprint) for the verifier and the
gateway alike."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from services.modeling.converted_cache import (
    COMPLETE_MARKER,
    complete_folder,
    converted_folder,
    ensure_converted,
)
from services.modeling.fetch import marker_path
from services.modeling.loading import load_model
from services.modeling.model_source import resolve_model_source
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from tests.unit.test_loading import save_tiny_llama


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    """A stand-in for a fetched GGUF file: the conversion only reads its name and size; the loader is given."""
    file = tmp_path / "cache" / "model.Q4.gguf"
    file.parent.mkdir()
    file.write_bytes(b"GGUF" + bytes(60))
    return file


@pytest.fixture
def tiny_loader(tmp_path: Path):
    """Loads a tiny llama and its tokenizer (what load_from_gguf returns), counting the calls."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    source = tmp_path / "tiny"
    save_tiny_llama(source)
    calls: list[int] = []

    def load():
        calls.append(1)
        return LlamaForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)

    load.calls = calls
    return load


def test_converted_once_then_reused(gguf_file: Path, tiny_loader) -> None:
    assert complete_folder(gguf_file) is None
    folder = ensure_converted(gguf_file, tiny_loader)
    assert folder == converted_folder(gguf_file) == complete_folder(gguf_file)
    assert {"config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER} <= {p.name for p in folder.iterdir()}
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in folder.iterdir())  # readable by other users of the cache
    assert ensure_converted(gguf_file, tiny_loader) == folder
    assert len(tiny_loader.calls) == 1
    assert not [p for p in gguf_file.parent.iterdir() if ".partial-" in p.name]


def test_a_folder_of_another_file_or_without_its_marker_is_converted_again(gguf_file: Path, tiny_loader) -> None:
    folder = ensure_converted(gguf_file, tiny_loader)
    gguf_file.write_bytes(b"GGUF" + bytes(80))  # another file under the same name (a re-fetch)
    assert complete_folder(gguf_file) is None
    assert ensure_converted(gguf_file, tiny_loader) == folder and len(tiny_loader.calls) == 2
    (folder / COMPLETE_MARKER).unlink()  # an interrupted conversion leaves no marker
    (folder / "stray").write_text("left from the interrupted attempt")
    assert ensure_converted(gguf_file, tiny_loader) == folder and len(tiny_loader.calls) == 3
    assert not (folder / "stray").exists()
    assert json.loads((folder / COMPLETE_MARKER).read_text())["gguf_bytes"] == 84
    marker_path(gguf_file).write_text("ab" * 32 + "\n")  # fetch verified other bytes of the same size
    assert complete_folder(gguf_file) is None
    assert ensure_converted(gguf_file, tiny_loader) == folder and len(tiny_loader.calls) == 4
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    (folder / COMPLETE_MARKER).write_text(json.dumps({**marker, "transformers": "4.0.0"}))  # made by another version
    assert complete_folder(gguf_file) is None


def test_a_cache_that_cannot_be_written_loads_from_the_gguf(gguf_file: Path, tiny_loader, caplog) -> None:
    (gguf_file.parent / ".lock").mkdir()  # opening the lock fails with an OSError, as on a read-only volume
    with caplog.at_level(logging.WARNING, logger="services.modeling.converted_cache"):
        assert ensure_converted(gguf_file, tiny_loader) is None
    assert "loading from the GGUF file" in caplog.text
    assert not converted_folder(gguf_file).exists()


@pytest.mark.slow
def test_the_converted_smollm2_is_the_gguf_load_exactly(smollm2) -> None:
    from services.gateway.tokenizer import load_tokenizer
    from services.modeling.gguf_tokenizer import load_gguf_tokenizer

    source = resolve_model_source("smollm2-135m-instruct")
    gguf_file = Path(source.path) / source.gguf_file
    direct = load_model(str(gguf_file), device="cpu", dtype="float32")  # a path: never converted
    assert direct.source.kind == "gguf" and smollm2.source.kind == "registered"
    assert complete_folder(gguf_file) is not None  # the session's smollm2 was loaded from the converted folder

    expected, got = direct.model.state_dict(), smollm2.model.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # where it came from, and `architectures`, which save_pretrained records (the GGUF path leaves it None)
    ignored = {"_name_or_path", "_model_name_or_path", "name_or_path", "transformers_version", "architectures"}
    assert ({k: v for k, v in smollm2.model.config.to_dict().items() if k not in ignored}
            == {k: v for k, v in direct.model.config.to_dict().items() if k not in ignored})
    assert smollm2.model.generation_config.to_dict() == direct.model.generation_config.to_dict()
    assert smollm2.eos_token_ids == direct.eos_token_ids

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <|im_end|> wörld 🙂"}]
    texts = ["Hello world", "  def f(x):\n\treturn x**2  # ünïcode", "<|im_start|>user\nhi<|im_end|>", ""]
    for tokenizer in (smollm2.tokenizer, load_tokenizer("smollm2-135m-instruct")):  # verifier's and gateway's
        assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(direct.tokenizer)
        assert tokenizer.all_special_tokens == direct.tokenizer.all_special_tokens
        for text in texts:
            ids = direct.tokenizer(text)["input_ids"]
            assert tokenizer(text)["input_ids"] == ids, text
            assert tokenizer.decode(ids) == direct.tokenizer.decode(ids)
            assert tokenizer.decode(ids, skip_special_tokens=True) == direct.tokenizer.decode(ids, skip_special_tokens=True)
        for prompt in (True, False):
            assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                    == direct.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))
    # the gateway without a converted folder (its own install, no verifier beside it) reads the GGUF: the same
    assert tokenizer_fingerprint(load_gguf_tokenizer(gguf_file)) == tokenizer_fingerprint(direct.tokenizer)

    ids = torch.tensor([direct.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(smollm2.model(input_ids=ids).logits, direct.model(input_ids=ids).logits)
