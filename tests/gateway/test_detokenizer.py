"""Incremental detokenization and stop strings, with a fake decode (ids are raw bytes) and the real byte-level
tokenizer: no character is ever split, and stop strings are caught across chunk boundaries."""

from __future__ import annotations

import pytest

from services.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tests.gateway.fakes import ids_of


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["héllo", "你好世界", "a🙂b", "ascii only", "🙂🙂"])
def test_one_token_at_a_time_never_splits_characters(text):
    detok = IncrementalDetokenizer(byte_decode)
    pieces = [detok.push([b]) for b in ids_of(text)] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # a 4-byte emoji comes out in one piece, never partially
    assert all(p in text for p in pieces)


def test_multi_token_steps_and_prompt_context():
    detok = IncrementalDetokenizer(byte_decode, prompt_ids=ids_of("prompt é"))
    ids = ids_of("x你好🙂")
    out = detok.push(ids[:2]) + detok.push(ids[2:5]) + detok.push(ids[5:]) + detok.flush()
    assert out == "x你好🙂"


def test_flush_releases_a_truly_invalid_tail():
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.push([0x61, 0xE4]) == ""  # "a" held back with the incomplete character
    assert detok.flush() == "a\ufffd"


def test_real_tokenizer(tokenizer):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(decode)
    text = "Grüße, 世界!"
    pieces = [detok.push([i]) for i in tokenizer(text)["input_ids"]]
    assert "".join(pieces) + detok.flush() == text


def feed(stops, chunks):
    matcher = StopStringMatcher(stops)
    out = []
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize("chunks,stops,expected,stopped", [
    (["Hello wor", "ld"], ["world"], "Hello ", True),
    (["ab", "c", "d"], ["cd"], "ab", True),
    (["a", "b", "c"], ["abx"], "abc", False),  # held prefix released at the end
    (["x<", "/s", ">y"], ["</s>"], "x", True),
    (["one STOP", " two"], ["STOP", "one"], "", True),  # earliest stop wins
    (["aab"], ["ab"], "a", True),
    (["no stops here"], [], "no stops here", False),
    (["ends with S"], ["STOP"], "ends with S", False),
])
def test_stop_strings(chunks, stops, expected, stopped):
    assert feed(stops, chunks) == (expected, stopped)


def test_held_text_is_not_emitted_early():
    matcher = StopStringMatcher(["END"])
    assert matcher.push("abcE") == ("abc", False)
    assert matcher.push("N") == ("", False)
    assert matcher.push("x") == ("ENx", False)
