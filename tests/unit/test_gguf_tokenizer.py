"""The gateway's torch-free GGUF tokenizer equals the one transformers builds through its own (torch-importing)
GGUF path: the same ids, decoding, chat rendering, special tokens and vocabulary fingerprint (which the gateway
checks against the verifier's at start-up)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.modeling.gguf_tokenizer import load_gguf_tokenizer
from services.modeling.model_source import resolve_model_source
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint

pytestmark = pytest.mark.slow  # reads SmolLM2's real GGUF file through transformers: the real model

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "def f(x):\n    return x * 2\n\n\tTabbed",
    "naïve café 日本語 🙂 Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "a" * 60,
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def pair() -> tuple[object, object]:
    source = resolve_model_source("smollm2-135m-instruct")
    theirs = AutoTokenizer.from_pretrained(source.path, **source.pretrained_kwargs())
    ours = load_gguf_tokenizer(Path(source.path) / source.gguf_file)
    return theirs, ours


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_and_decoding(pair, text: str) -> None:
    theirs, ours = pair
    ids = theirs(text, add_special_tokens=True)["input_ids"]
    assert ours(text, add_special_tokens=True)["input_ids"] == ids
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_same_chat_rendering_special_tokens_and_vocabulary(pair) -> None:
    theirs, ours = pair
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt) == (
            theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
        )
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.unk_token
    )
    assert len(ours) == len(theirs)
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(theirs)
