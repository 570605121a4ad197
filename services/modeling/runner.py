"""The model-runner contract shared by the verifier and by model-based drafters.

A runner owns the KV memory of up to `max_num_seqs` sequences. Each forward feeds some new tokens per sequence,
writes their K/V at the sequence's current length and advances it; `truncate` rolls a sequence back after
rejected drafts by setting its length (no copy, the stale entries are masked and later overwritten).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RowInput:
    """One sequence's part of a forward: tokens fed now, and how many of the last fed positions need logits."""

    seq_id: Hashable
    token_ids: Sequence[int]
    num_logits: int = 1


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [B, max num_logits, V] float32; row b valid in [:num_logits_b], i.e. its last positions
    hidden_states: torch.Tensor  # [B, L, H] final (normed) hidden states of the fed tokens; row b valid in [:len_b]


class ModelRunner(Protocol):
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    device: torch.device

    def add_sequence(self, seq_id: Hashable) -> None:
        """Reserve KV memory for a new sequence (length 0). Raises RuntimeError when no slot is free."""

    def remove_sequence(self, seq_id: Hashable) -> None:
        """Free the sequence's KV memory."""

    def num_free_slots(self) -> int: ...

    def length(self, seq_id: Hashable) -> int:
        """Tokens whose K/V are in the cache."""

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Roll back to `length` tokens (drop rejected drafts)."""

    def forward(self, rows: Sequence[RowInput]) -> ForwardOutput:
        """Feed each row's tokens at its current length and advance it; rows must name distinct sequences."""
