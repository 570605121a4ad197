"""What both verification tails in the step's graph (captured_verify.VerifyTail for chains,
captured_tree_verify.TreeVerifyTail for trees) carry of each row besides its drafts, and how it rides in their
inputs: its number of drafted tokens, the position its first emitted token takes, its seed, whether it is greedy,
and its temperature (1 for greedy rows, as SamplingBatch holds them). The int64 columns come last in each row of
a tail's ints, the temperatures after all rows as float64 bits; padding rows draft nothing, greedily."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.verifier.request_state import RequestState
from services.verifier.sampling_batch import SamplingBatch

COLUMNS = 4  # number of drafts, position, seed, greedy


@dataclass(frozen=True)
class TailRows:
    """The fields both tails carry of each row besides its drafts (sampling_fields gives them): whether any row
    samples (the graph's key), the position each row's first emitted token takes, its seed, whether it is greedy
    and its temperature."""

    sampled: bool
    positions: tuple[int, ...] = ()
    seeds: tuple[int, ...] = ()
    greedy: tuple[bool, ...] = ()
    temperatures: tuple[float, ...] = ()

    def pack_rows(self, ints: np.ndarray, counts: Sequence[int]) -> torch.Tensor:
        """The tail's inputs: `ints` with these rows' columns and `counts` (drafted tokens a row) written in."""
        return pack(ints, counts, self.positions, self.seeds, self.greedy, self.temperatures)


def sampling_fields(states: Sequence[RequestState]) -> dict[str, Any]:
    """A tail's fields of each row's sampling, by name: sampled, positions, seeds, greedy, temperatures."""
    sampling = [state.request.sampling for state in states]
    greedy = tuple(s.greedy for s in sampling)
    return dict(sampled=not all(greedy), positions=tuple(len(state.token_ids) for state in states),
                seeds=tuple(s.seed for s in states), greedy=greedy,
                temperatures=tuple(1.0 if g else s.temperature for s, g in zip(sampling, greedy, strict=True)))


def pack(ints: np.ndarray, counts: Sequence[int], positions: Sequence[int], seeds: Sequence[int],
         greedy: Sequence[bool], temperatures: Sequence[float]) -> torch.Tensor:
    """A tail's inputs: `ints` [rows, ...] with each row's COLUMNS written into its last columns, then the
    temperatures' bits."""
    rows, real, first = ints.shape[0], len(counts), ints.shape[1] - COLUMNS
    ints[:real, first], ints[:real, first + 1], ints[:real, first + 2], ints[:real, first + 3] = (
        counts, positions, seeds, greedy)
    ints[real:, first + 3] = 1
    bits = np.ones(rows, dtype=np.float64)
    bits[:real] = temperatures
    return torch.from_numpy(np.concatenate([ints.reshape(-1), bits.view(np.int64)]))


def unpack(inputs: torch.Tensor, rows: int, per_row: int, vocab: int, sampled: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SamplingBatch]:
    """(the ints [rows, per_row], each row's number of drafts, its position, its SamplingBatch) on the device."""
    ints = inputs[: rows * per_row].view(rows, per_row)
    temperature = inputs[rows * per_row :].view(torch.float64).float()
    counts, positions, seeds, greedy = (ints[:, per_row - COLUMNS + i] for i in range(COLUMNS))
    return ints, counts, positions, SamplingBatch.temperature_only(temperature, greedy.bool(), seeds, vocab, sampled)
