"""Sizes in bytes as people write them on a command line: '4GiB', '512M', '1.5g', '1000000'."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30,
          "ti": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """Binary units with an i (GiB = 2**30), decimal ones without (G = 10**9), an optional B; plain digits are
    bytes. ValueError for anything else."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text).lower())
    if not match:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 4GiB, 512MiB, 2G or 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
