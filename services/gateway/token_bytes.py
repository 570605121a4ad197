"""A token's own bytes: the `bytes` of a chat logprob entry (OpenAI: "useful in instances where characters are
represented by multiple tokens and their byte representations must be combined to generate the correct text").

A token's text, decoded alone, is not its bytes where it holds part of a character: an emoji of four bytes comes as
two or three tokens, each decoding alone to U+FFFD, whose UTF-8 (239, 191, 189) the entries gave as their bytes, so
joining the bytes of a reply's entries gave replacement characters where the reply had the emoji. The bytes are
read from the vocabulary instead: a byte-level BPE (GPT-2's scheme, as SmolLM2's, Qwen's and Llama 3's tokenizers)
spells each byte as one character, transformers' `bytes_to_unicode` gives that spelling, and a byte-fallback token
of a SentencePiece vocabulary (Llama 2, Mistral) is named `<0xAB>`. Any other token (a special token, written as it
reads; a whole-word piece) is its decoded text, whose UTF-8 is then its bytes. An added token that is not special
goes through the byte-level decoder as the others do (tokenizers decodes it so), and so here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.tokenizer import token_text

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


class TokenBytes:
    """`token_bytes(token_id)`: the token's bytes, as a list of ints (each token's worked out once: at most the
    vocabulary's)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_of = _byte_level_alphabet(tokenizer)  # None: not a byte-level vocabulary
        self._known: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        found = self._known.get(token_id)
        if found is None:
            found = self._known[token_id] = list(self._bytes(token_id))
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._tokenizer.all_special_ids:
            byte_of = self._byte_of
            if byte_of is not None and piece and all(char in byte_of for char in piece):
                return bytes(byte_of[char] for char in piece)
            fallback = BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
        return token_text(self._tokenizer, token_id).encode("utf-8")


def _byte_level_alphabet(tokenizer: Any) -> dict[str, int] | None:
    """Character -> byte of GPT-2's byte-level spelling, where the tokenizer decodes with a ByteLevel decoder (alone
    or in a sequence); None otherwise (a slow tokenizer, another scheme)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        described = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    kinds = {described.get("type")} | {part.get("type") for part in described.get("decoders") or ()}
    if "ByteLevel" not in kinds:
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
