"""A short digest of a tokenizer's vocabulary, so processes that exchange token ids can tell whether they mean
the same thing by them.

The gateway tokenizes, the verifier runs the model and a drafter may propose from its own tokenizer; all three
only exchange ids. Two tokenizers agree on ids exactly when their token -> id maps agree, so the digest covers
that map (added and special tokens included, as `get_vocab` reports them) and nothing else: no paths, no file
formats, so a copy of the same tokenizer anywhere fingerprints the same.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 hex of the sorted (token, id) pairs; "" for an object without a vocabulary (nothing to compare)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return ""
    pairs = sorted(get_vocab().items(), key=lambda pair: (pair[1], pair[0]))
    encoded = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()
