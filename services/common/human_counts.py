"""Counts as vLLM's command line takes them (its human_readable_int): `--max-model-len 32k` is 32,000, `32K` is
32,768, `25.6k` is 25,600, plain digits are themselves."""

from __future__ import annotations

import argparse
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An argparse type: lowercase suffixes decimal (fractions allowed), uppercase ones binary (whole numbers)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 4096, 32k = 32,000, 32K = 32,768)")
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction needs a decimal suffix (k, m, g, t), e.g. 25.6k")
    return int(number) * _BINARY.get(suffix, 1)
