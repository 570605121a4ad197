"""Pre-allocated KV slots: one slot per running sequence, `max_model_len` positions each.

Sequences are kept in the lowest slots (a freed slot is refilled by moving the highest one down), so the usual
batch - every running sequence - is a contiguous slot range and attention reads the cache through a view
instead of gathering it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, max_num_seqs, num_kv_heads, max_model_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, Hkv, T, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._slot_of: dict[Hashable, int] = {}
        self._seq_in: list[Hashable | None] = [None] * max_num_seqs
        self._lengths = [0] * max_num_seqs

    def add(self, seq_id: Hashable) -> None:
        if seq_id in self._slot_of:
            raise ValueError(f"sequence {seq_id!r} already has a KV slot")
        slot = len(self._slot_of)
        if slot >= self.max_num_seqs:
            raise RuntimeError(f"no free KV slot (max_num_seqs={self.max_num_seqs})")
        self._slot_of[seq_id] = slot
        self._seq_in[slot] = seq_id
        self._lengths[slot] = 0

    def remove(self, seq_id: Hashable) -> None:
        slot = self._slot_of.pop(seq_id)
        last = len(self._slot_of)  # the highest occupied slot before removal
        if slot != last:
            moved = self._seq_in[last]
            n = self._lengths[last]
            self.keys[:, slot, :, :n] = self.keys[:, last, :, :n]
            self.values[:, slot, :, :n] = self.values[:, last, :, :n]
            self._slot_of[moved] = slot
            self._seq_in[slot] = moved
            self._lengths[slot] = n
        self._seq_in[last] = None
        self._lengths[last] = 0

    def num_free(self) -> int:
        return self.max_num_seqs - len(self._slot_of)

    def slot(self, seq_id: Hashable) -> int:
        return self._slot_of[seq_id]

    def length(self, seq_id: Hashable) -> int:
        return self._lengths[self._slot_of[seq_id]]

    def set_length(self, seq_id: Hashable, length: int) -> None:
        if not 0 <= length <= self.max_model_len:
            raise ValueError(f"length {length} outside [0, {self.max_model_len}]")
        self._lengths[self._slot_of[seq_id]] = length

    def layer_view(self, layer: int, slots: Sequence[int], num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` for the first `num_positions` positions: [B, Hkv, T, D] each.

        A view when the slots are consecutive (the steady state), a gather otherwise.
        """
        first = slots[0]
        if list(slots) == list(range(first, first + len(slots))):
            rows = slice(first, first + len(slots))
            return self.keys[layer, rows, :, :num_positions], self.values[layer, rows, :, :num_positions]
        index = torch.tensor(slots, device=self.keys.device)
        return self.keys[layer, index, :, :num_positions], self.values[layer, index, :, :num_positions]
