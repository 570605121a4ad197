"""The target's hidden states a request keeps on the host (for its EAGLE drafter, or to extract them), appended a
step at a time and read as one tensor [n, H].

Every step every such row appends the states of the tokens it committed. Through torch that cost about 12 us a row
(slicing the row out of the step's states, then copying it into the request's buffer: 0.8 ms a step at 64 rows on a
2-core EPYC, beside a captured H100 step of about 5 ms), paid at every step although under load the planner asks
EAGLE for drafts at a few steps in ten. numpy does the same in about 1 us, so a step's states go over as numpy views
of their bits (numpy has no bfloat16: a 16-bit float's bits go as int16), a row at a time as RowStates, and a read
wraps the buffer as a tensor of the states' dtype again without a copy.

A step's rows are not even copied when they come: a request keeps them as views (pending) and copies them into its
buffer, all in one, when it is read (when its drafter is asked), when MAX_PENDING steps wait or when a prefill
chunk's states come. Copied at once, each row cost about 7.5 us, most of it the first touch of the buffer's
fresh pages (2.5 us into pages already touched), at every step whether the drafter was asked or not. A request
never asked before it ends copies no step's rows. A step's states are a host tensor of their own that nothing
writes after the step (a device's copy, or a CPU forward's own output), so a view of them stays what it was.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from services.common.growing_rows import GrowingRows

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a same-size integer type per element size
MAX_PENDING = 128  # steps' rows a request holds as views at most: each keeps its step's host states alive


def bits_of(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a numpy array of their bits (a view, no copy)."""
    return tensor.detach().view(_BITS[tensor.element_size()]).numpy()


class RowStates(NamedTuple):
    """One row's states of one step: `bits` [m, H] of `dtype` values (a view into the step's StepStates)."""

    bits: np.ndarray
    dtype: torch.dtype


class StepStates:
    """One step's states [rows, width, H] on the host, handed out a row at a time (as views: `states` must be a tensor
    that nothing writes afterwards)."""

    def __init__(self, states: torch.Tensor) -> None:
        self._bits = bits_of(states)
        self._dtype = states.dtype

    def row(self, row: int, columns: slice | list[int]) -> RowStates:
        """Row `row`'s states at `columns` (increasing positions: a chain's prefix or a tree's path)."""
        if isinstance(columns, list) and columns and columns[-1] - columns[0] + 1 == len(columns):
            columns = slice(columns[0], columns[-1] + 1)  # a run: a view, where a list of positions copies
        return RowStates(self._bits[row, columns], self._dtype)


class KeptStates:
    """A request's states [n, H], one per committed token the target has run on, handed to it by each step that
    commits some (runner_kept_states.py keeps them in the runner instead, where the runner can)."""

    fed_by_steps = True  # steps are its only source: each hands it the states it committed (step_execution.py)

    def __init__(self, states: torch.Tensor | None = None) -> None:
        self._rows = GrowingRows()
        self._dtype: torch.dtype | None = None
        self._pending: list[np.ndarray] = []  # a step's rows each, not copied yet (the module docstring says why)
        self._num_pending = 0
        if states is not None:
            self.append(states)

    def __len__(self) -> int:
        return len(self._rows) + self._num_pending

    def append(self, states: torch.Tensor | RowStates) -> None:
        """Append rows [m, H]: a host tensor (a prefill chunk's, a cached prefix's: copied now, so a chunk's pinned
        copy is not held) or a step's RowStates (kept as a view until read, or until MAX_PENDING steps wait)."""
        copy_now = isinstance(states, torch.Tensor)
        if copy_now:
            states = RowStates(bits_of(states), states.dtype)
        if self._dtype is None:
            self._dtype = states.dtype
        elif states.dtype != self._dtype:
            raise ValueError(f"states of {states.dtype} appended to states of {self._dtype}")
        self._pending.append(states.bits)
        self._num_pending += states.bits.shape[0]
        if copy_now or len(self._pending) >= MAX_PENDING:
            self._copy_pending()

    def takes_step_states(self, drafting: bool) -> bool:
        """Whether the step about to run hands the request the states of what it commits (`drafting`: its row
        verifies a draft in it). Always, here."""
        return True

    def cleared(self) -> KeptStates:
        """An empty one of the same kind (the request computes its states again from the start)."""
        return KeptStates()

    def attach(self) -> None:
        """The request holds its slot in the runner again (states kept there can be read)."""

    def detach(self) -> None:
        """The request is about to give its slot in the runner back."""

    def view(self) -> torch.Tensor | None:
        """The rows so far as one tensor (a view of the buffer; later appends do not change it); None while empty."""
        self._copy_pending()
        bits = self._rows.view()
        return None if bits is None else torch.from_numpy(bits).view(self._dtype)

    def _copy_pending(self) -> None:
        """The pending rows into the buffer, in order, in one copy."""
        if not self._pending:
            return
        np.concatenate(self._pending, out=self._rows.extend(self._num_pending, self._pending[0]))
        self._pending.clear()
        self._num_pending = 0
