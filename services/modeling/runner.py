"""The model-runner contract shared by the verifier and by model-based drafters.

A runner holds the KV memory of up to `max_num_seqs` sequences. Each forward feeds some new tokens per sequence,
writes their K/V at the sequence's current length and advances it; `truncate` rolls a sequence back after
rejected drafts. The llama-family runner keeps K/V in a paged pool (paged_kv_cache.py): memory is taken as
tokens arrive, `reserve` takes it ahead of a forward so that a scheduler can check it fits, and a new sequence
reuses the cached blocks of its prompt's longest cached prefix.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from services.modeling.block_pool import PrefixCacheStats

if TYPE_CHECKING:  # step_graphs imports this module's RowInput (through forward_batch)
    from services.modeling.step_graphs import GraphTail


@dataclass(frozen=True)
class RowInput:
    """One sequence's part of a forward: tokens fed now, and how many of the last fed positions need logits.

    parents makes the fed tokens a tree (drafts that branch): parents[i] is the index among the fed tokens of
    token i's parent, -1 where it follows the cached tokens directly, and every parent comes before its children.
    Token i then sits at position length + depth(i) and attends to the cached tokens and its own ancestors only,
    so its logits are those of the path that leads to it. None: a chain (parents[i] = i - 1)."""

    seq_id: Hashable
    token_ids: Sequence[int]
    num_logits: int = 1
    parents: Sequence[int] | None = None


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [B, max num_logits, V] float32; row b valid in [:num_logits_b], i.e. its last positions
    # [B, L, layers * H] the fed tokens' hidden states of the runner's served layers (hidden_layers.py; by default
    # the final normed one); row b valid in [:len_b]
    hidden_states: torch.Tensor


@dataclass(frozen=True)
class KVUsage:
    """The KV pool now: blocks in all, held by sequences, cached by content; prefix-cache counters."""

    total_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size: int
    prefix_cache: PrefixCacheStats

    @property
    def fraction_used(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


class ModelRunner(Protocol):
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    device: torch.device

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        """Start a sequence. Given its prompt, it starts with the longest cached prefix of it in the cache and
        the number of those tokens is returned (0 without prefix caching). RuntimeError when max_num_seqs
        sequences are running."""

    def remove_sequence(self, seq_id: Hashable) -> None:
        """Free the sequence's KV memory."""

    def num_free_slots(self) -> int: ...

    def length(self, seq_id: Hashable) -> int:
        """Tokens whose K/V are in the cache."""

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Roll back to `length` tokens (drop rejected drafts)."""

    def keep_path(self, seq_id: Hashable, start: int, path: Sequence[int]) -> None:
        """After a forward that fed a token tree at `start`: keep only the nodes `path` (indices among the fed
        tokens, root first, each the parent of the next), moved to positions start, start + 1, ...; the rest of
        the tree is dropped. Runners without `supports_trees` need not have it."""

    def kv_blocks_needed(self, seq_id: Hashable | None, length: int) -> int:
        """KV blocks a sequence (None: a new one) still needs to hold `length` tokens."""

    def kv_blocks_available(self) -> int:
        """KV blocks that can be taken now."""

    def reserve(self, seq_id: Hashable, length: int) -> None:
        """Take the KV memory for `length` tokens now; KVCacheFullError (nothing taken) when it is not there."""

    @property
    def kv_usage(self) -> KVUsage: ...

    def forward(self, rows: Sequence[RowInput]) -> ForwardOutput:
        """Feed each row's tokens at its current length and advance it; rows must name distinct sequences."""

    def capture_graphs(self, max_width: int, tails: Sequence[GraphTail] = ()) -> int:
        """On an accelerator, capture the forwards of short sequences of up to `max_width` tokens a row before the
        first request (step_graphs.py), plain and with each of `tails`; returns how many graphs were captured (0:
        forwards run eagerly). A runner whose graphs take tails also has `forward_with_tail` (llama_runner.py)."""
