"""Output decoding (tokenizer.make_decode): the direct call into a fast tokenizer's Rust decoder gives exactly what
transformers' decode gives, and a tokenizer whose decode does more is decoded by transformers."""

from __future__ import annotations

import random

import pytest

from services.gateway.tokenizer import _plain_fast_backend, load_tokenizer, make_decode
from services.modeling.registry import DEFAULT_MODEL
from tests.gateway.fakes import byte_tokenizer


@pytest.mark.parametrize("which", ["byte-level test tokenizer", DEFAULT_MODEL])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_direct_decode_equals_transformers_decode(which, skip_special_tokens):
    tokenizer = byte_tokenizer() if which.startswith("byte") else load_tokenizer(which)
    assert _plain_fast_backend(tokenizer) is not None  # the direct path is the one under test
    decode = make_decode(tokenizer, skip_special_tokens)
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    for _ in range(2000):  # random ids: partial characters, special tokens among text, single ids
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 12))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_by_transformers():
    tokenizer = byte_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    assert _plain_fast_backend(tokenizer) is None
    assert make_decode(tokenizer)(list(b"a , b")) == tokenizer.decode(list(b"a , b"), skip_special_tokens=True)


def test_a_subclass_with_its_own_decode_is_decoded_by_it():
    class Shouting(type(byte_tokenizer())):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    base = byte_tokenizer()
    tokenizer = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>")
    assert _plain_fast_backend(tokenizer) is None
    assert make_decode(tokenizer)(list(b"shout")) == "SHOUT"
