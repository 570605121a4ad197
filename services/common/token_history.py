"""A sequence's committed tokens as the drafter service keeps them (and the engine, for in-process proposers:
RequestState.committed_view): appended in place, read without a copy.

Why: the service hands every proposer the whole committed sequence each step (the Proposer protocol), and kept it
as a Python list, which the n-gram drafter converted to a numpy array every step: 28-46 us a sequence at 1,000
tokens and 170 us at 4,000 on a 2-core EPYC, for every row of every step (2-3 ms a step at 64 rows of 1,000
tokens), where its lookup takes 15 us. Here the tokens live in an int64 buffer that doubles when full
(as growing_rows.py's), and a step reads them as a TokenView: a read-only Sequence of ints that `np.asarray` turns into
the buffer's own rows, without a copy.

A view is a snapshot: later appends write past its rows or into a new buffer, so a proposer that keeps it (a
pre-draft) reads the tokens of its own step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from services.common.growing_rows import grown_capacity


class TokenView(Sequence[int]):
    """Read-only int64 tokens; items are Python ints, slices are views too, numpy reads them as they are."""

    __slots__ = ("_array",)

    def __init__(self, array: np.ndarray) -> None:
        if array.flags.writeable:  # the history's buffer: a view that cannot write to it (a slice of one is already)
            array = array.view()
            array.flags.writeable = False
        self._array = array

    def __len__(self) -> int:
        return len(self._array)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> TokenView: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return TokenView(self._array[index])
        return int(self._array[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self._array.tolist())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if copy or (dtype is not None and np.dtype(dtype) != self._array.dtype):
            return self._array.astype(dtype or self._array.dtype)
        return self._array

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenView | list | tuple | np.ndarray):
            return len(self) == len(other) and bool(np.array_equal(self._array, np.asarray(other)))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment] - equal to lists, which are not hashable

    def __repr__(self) -> str:
        return f"TokenView({self._array.tolist()!r})"


EMPTY = np.zeros(0, dtype=np.int64)
EMPTY.flags.writeable = False  # shared by every empty view: nothing may write to it


class TokenHistory:
    """The committed tokens of one sequence, extended as steps commit more: an int64 buffer whose capacity doubles
    when full (growing_rows.grown_capacity), with a read-only alias of it made once per buffer, so that a view is
    a slice of the alias (a step takes one view a row: making each view read-only on its own cost it as much as
    the append). Not a GrowingRows: that keeps 2-D rows of numpy or torch alike, made like the first rows, and
    appending one token through it cost a list-to-array conversion more."""

    __slots__ = ("_buffer", "_readonly", "_length")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._length = 0
        self._buffer = self._readonly = EMPTY
        self.extend(tokens)

    def __len__(self) -> int:
        return self._length

    def extend(self, tokens: Sequence[int]) -> None:
        count = len(tokens)
        if count == 0:
            return
        needed = self._length + count
        if needed > len(self._buffer):
            self._grow(grown_capacity(self._length, needed))
        self._buffer[self._length : needed] = tokens
        self._length = needed

    def view(self) -> TokenView:
        """The tokens so far (a snapshot: see the module docstring)."""
        return TokenView(self._readonly[: self._length])

    def _grow(self, capacity: int) -> None:
        buffer = np.empty(capacity, dtype=np.int64)
        buffer[: self._length] = self._buffer[: self._length]
        readonly = buffer.view()
        readonly.flags.writeable = False
        self._buffer, self._readonly = buffer, readonly
