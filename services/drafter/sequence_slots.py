"""Which sequences keep a KV slot in a model-based drafter, what each slot holds, and who is evicted.

A drafter serves any number of verifiers, so it cannot promise every sequence a slot: it has a fixed number
(--max-num-seqs) and gives them to the sequences it is asked about. When a new sequence finds every slot taken,
the least recently drafted sequence that is not in the same call loses its slot. Losing a slot costs only
time: the proposer always receives a sequence's whole committed token ids, so an evicted sequence that comes
back is prefilled again from them (a resync), never an error.

Each slot records the token ids whose K/V it holds, which may run past the committed tokens (the drafts fed
to draft the next position). The next call keeps the longest common prefix of those and the newly committed
tokens and truncates the rest, so accepted drafts are never fed twice and rejected ones are dropped by setting
the length. Comparing token ids, not lengths, is what keeps the cache right whatever the caller did in between
(a rollback, a re-opened sequence, a reused id): a wrong cache is impossible, at worst a prefix is recomputed.

Pure bookkeeping, no tensors: the caller applies the evictions and admissions to the model runner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotAssignment:
    """The outcome of `SequenceSlots.assign`: what to remove from and add to the runner, in this order."""

    evicted: tuple[Hashable, ...] = ()  # lost their slot (remove_sequence), least recently used first
    admitted: tuple[Hashable, ...] = ()  # new in a slot (add_sequence), holding no tokens yet
    refused: tuple[Hashable, ...] = ()  # found no slot this call: no draft for them now


class SequenceSlots:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"need at least one slot, got {capacity}")
        self.capacity = capacity
        self._tokens: OrderedDict[Hashable, np.ndarray] = OrderedDict()  # least recently used first

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def tokens(self, seq_id: Hashable) -> np.ndarray:
        """The token ids whose K/V the sequence's slot holds (the runner's length is their count)."""
        return self._tokens[seq_id]

    def set_tokens(self, seq_id: Hashable, token_ids: np.ndarray) -> None:
        """Record what the slot holds now (an array the caller no longer changes)."""
        self._tokens[seq_id] = token_ids

    def assign(self, seq_ids: Sequence[Hashable]) -> SlotAssignment:
        """Slots for the sequences of one call, in the order given (distinct ids). Those that hold one keep it;
        the others take a free slot, else the least recently used slot of a sequence outside this call; when
        every slot belongs to this call, the rest are refused. Every sequence of the call that holds a slot
        afterwards becomes the most recently used, in the call's order."""
        wanted = set(seq_ids)
        if len(wanted) != len(seq_ids):
            raise ValueError("a call names a sequence at most once")
        evicted: list[Hashable] = []
        admitted: list[Hashable] = []
        refused: list[Hashable] = []
        victims = (seq_id for seq_id in list(self._tokens) if seq_id not in wanted)  # least recently used first
        for seq_id in seq_ids:
            if seq_id in self._tokens:
                continue
            if len(self._tokens) >= self.capacity:
                victim = next(victims, None)
                if victim is None:
                    refused.append(seq_id)
                    continue
                del self._tokens[victim]
                evicted.append(victim)
            self._tokens[seq_id] = np.empty(0, dtype=np.int64)
            admitted.append(seq_id)
        for seq_id in seq_ids:
            if seq_id in self._tokens:
                self._tokens.move_to_end(seq_id)
        return SlotAssignment(tuple(evicted), tuple(admitted), tuple(refused))

    def drop(self, seq_id: Hashable) -> bool:
        """Forget the sequence; True when it held a slot (the caller frees it in the runner)."""
        return self._tokens.pop(seq_id, None) is not None


def common_prefix_length(cached: np.ndarray, committed: np.ndarray) -> int:
    """Length of the longest common prefix of two token id arrays (vectorised: a step compares up to
    max_model_len ids per sequence)."""
    n = min(len(cached), len(committed))
    if n == 0:
        return 0
    differ = np.flatnonzero(cached[:n] != committed[:n])
    return int(differ[0]) if differ.size else n
