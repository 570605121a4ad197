"""Rows appended a few at a time and read as one [n, H] array, without copying the whole history on each read.

EAGLE drafters read the target's hidden states of every committed token; the verifier receives them a step at a
time (the last committed token and the accepted drafts) and the drafter service a call at a time. Kept as a list
of chunks, concatenated when read, every step copied each sequence's whole history once more: at 2,048 tokens of
SmolLM2's 576-wide states, about 3.6 ms per sequence per step on a 2-core CPU across the verifier and the drafter,
growing with the context. Here appends write into a buffer whose capacity doubles when full, so a row is copied
O(1) times on average and a read is a view.

A view stays valid after later appends: they write past its rows, or into a new buffer. Works for numpy arrays
and torch tensors alike (the buffer is made like the first rows: same dtype, same device).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_CAPACITY = 64


def grown_capacity(length: int, needed: int) -> int:
    """The capacity a buffer holding `length` rows grows to when `needed` do not fit: doubled, and at least
    `needed` and MIN_CAPACITY (so a row is copied O(1) times on average). token_history.py's buffer grows so too.
    An empty buffer's first rows get as much room again: every user appends after its first rows (a prompt's, then
    a step's), and sized to them exactly the first append copied them all (an EAGLE head's cache: two copy launches
    a sequence at its first ask after its opening, 104 at 52 chats on a GPU)."""
    return max(2 * needed if length == 0 else needed, 2 * length, MIN_CAPACITY)


class GrowingRows:
    """Rows [n, H] appended in chunks; `view()` is the first n rows of one buffer."""

    def __init__(self, rows: Any = None) -> None:
        self._buffer: Any = None
        self._length = 0
        if rows is not None:
            self.append(rows)

    def __len__(self) -> int:
        return self._length

    def append(self, rows: Any) -> None:
        """Append `rows` [m, H] (a numpy array or a torch tensor, like those before)."""
        if rows.shape[0]:
            self.extend(rows.shape[0], rows)[:] = rows

    def extend(self, count: int, like: Any) -> Any:
        """Count in `count` more rows made like `like` and return their place in the buffer, for the caller to
        write before the next read: a drafter then writes the new rows of many sequences in one grouped copy."""
        needed = self._length + count
        if self._buffer is None or needed > self._buffer.shape[0]:
            self._grow(like, grown_capacity(self._length, needed))
        rows = self._buffer[self._length : needed]
        self._length = needed
        return rows

    def view(self) -> Any:
        """The rows so far as one [n, H] array (a view into the buffer; None while empty)."""
        return None if self._length == 0 else self._buffer[: self._length]

    def _grow(self, like: Any, capacity: int) -> None:
        shape = (capacity, *like.shape[1:])
        buffer = like.new_empty(shape) if hasattr(like, "new_empty") else np.empty(shape, dtype=like.dtype)
        if self._length:
            buffer[: self._length] = self._buffer[: self._length]
        self._buffer = buffer

