"""A paged KV cache: one pool of fixed-size blocks shared by every sequence, a block table per sequence.

Memory is proportional to the tokens held, not to max_num_seqs x max_model_len: blocks are taken as tokens
arrive, freed when a sequence ends, and a rollback after rejected drafts gives back whole blocks past the new
length. Full blocks are published by content (block_pool.py), so a new sequence whose prompt starts with a
cached prefix takes those blocks instead of computing them again.

Layout: keys and values are [layers, kv_heads, num_blocks * block_size, head_dim], so a layer's cache is one
tensor whose positions (slots) are rows of head_dim values. A sequence whose blocks lie in order (the pool keeps
them so where it can) is read as a view, without a copy; a batch can also be read by gathering every row's
positions into one padded [kv_heads, rows, T, head_dim] buffer (the runner picks, attention_paths.py). The pool
is zeroed when it is made (resident from the start: kv_budget.py says why); the null block, which padded
positions read, stays zero, so a masked score is never NaN.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from services.modeling.block_pool import NULL_BLOCK, BlockPool, KVCacheFullError

DEFAULT_BLOCK_SIZE = 16

__all__ = ["DEFAULT_BLOCK_SIZE", "KVCacheFullError", "PagedKVCache"]


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V are held, in order
    published: int = 0  # leading full blocks already published by content


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_prefix_caching: bool = True,
    ) -> None:
        # One block past the pool's: the sink, never handed out, where a padded batch (a captured graph's) writes
        # the K/V of its padding, so that the null block stays zero.
        shape = (num_layers, num_kv_heads, (num_blocks + 1) * block_size, head_dim)
        self.sink_slot = num_blocks * block_size
        # Written through once (zeros): on CPU an untouched allocation is only address space, so the pool would
        # be a budget nobody else sees. Several processes on one host (a verifier, a model drafter, another
        # stack) each sized their pools from the same MemAvailable, and together could fill more memory than
        # there is once traffic wrote their blocks. Written, the pool is resident from the start, as vLLM's is,
        # and the next process sizes its own from what is really left.
        self.keys = torch.empty(shape, dtype=dtype, device=device).zero_()
        self.values = torch.empty(shape, dtype=dtype, device=device).zero_()
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._seqs: dict[Hashable, _Sequence] = {}
        self.hidden: torch.Tensor | None = None  # [slots, H] when kept (keep_hidden_states)

    def keep_hidden_states(self, width: int, dtype: torch.dtype) -> None:
        """Keep each position's served hidden states (`width` wide) beside its K/V, in the same slot, so that a
        sequence that starts from a cached prefix can have the prefix's states too (an EAGLE drafter reads them):
        with them its prompt reuses cached blocks like any other. Blocks cached before are forgotten: they have no
        states. (A runner that changes its layers drops the kept ones first: forget_hidden_states.)"""
        if self.hidden is not None:
            return
        if self._seqs:
            raise RuntimeError("keep_hidden_states must be called while no sequence holds blocks")
        self.pool.forget_all()
        self.hidden = torch.zeros(self.keys.shape[2], width, dtype=dtype, device=self.keys.device)

    def forget_hidden_states(self) -> None:
        """Stop keeping states (the runner is about to serve other layers): cached blocks are forgotten with them."""
        if self.hidden is None:
            return
        if self._seqs:
            raise RuntimeError("the served hidden layers can change only while no sequence holds blocks")
        self.pool.forget_all()
        self.hidden = None

    def hidden_states_of(self, ranges: Sequence[tuple[Hashable, int, int]]) -> torch.Tensor:
        """[sum of the ranges' lengths, width]: the kept states of each (sequence, start, stop) range's positions,
        in order, in one gather on the device."""
        if self.hidden is None:
            raise RuntimeError("hidden states are not kept (keep_hidden_states)")
        slots = np.concatenate([self.slot_array(seq_id, start, stop) for seq_id, start, stop in ranges])
        return self.hidden[torch.from_numpy(slots).to(self.hidden.device)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one position in every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_blocks * self.block_size

    # -- sequences ------------------------------------------------------------------------------------------
    def add(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        """Start a sequence; with its prompt, take the cached blocks of the prompt's longest cached prefix and
        return how many tokens they hold (a multiple of the block size, and always less than the prompt: its
        last token is computed, so that the forward gives its logits)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has KV blocks")
        seq = _Sequence()
        if prompt:
            seq.blocks = self.pool.match(prompt, (len(prompt) - 1) // self.block_size)
            seq.tokens = list(prompt[: len(seq.blocks) * self.block_size])
            seq.published = len(seq.blocks)
        self._seqs[seq_id] = seq
        return len(seq.tokens)

    def remove(self, seq_id: Hashable) -> None:
        for block in self._seqs.pop(seq_id).blocks:
            self.pool.release(block)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def length(self, seq_id: Hashable) -> int:
        return len(self._seqs[seq_id].tokens)

    def blocks_needed(self, seq_id: Hashable | None, length: int) -> int:
        """New blocks a sequence (None: a new one) needs to hold `length` tokens."""
        held = len(self._seqs[seq_id].blocks) if seq_id is not None else 0
        return max(0, -(-length // self.block_size) - held)

    def num_available_blocks(self) -> int:
        return self.pool.num_available()

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Keep the first `length` tokens; whole blocks past them go back to the pool. A kept full block that
        is published stops being findable (it will be overwritten) or, when another sequence shares it, is
        copied first."""
        seq = self._seqs[seq_id]
        if not 0 <= length <= len(seq.tokens):
            raise ValueError(f"length {length} outside [0, {len(seq.tokens)}]")
        del seq.tokens[length:]
        keep = -(-length // self.block_size)
        for block in seq.blocks[keep:]:
            self.pool.release(block)
        del seq.blocks[keep:]
        partial = length // self.block_size  # index of the block that now ends mid-way, if any
        if length % self.block_size and partial < seq.published:
            self._make_writable(seq, partial)
        seq.published = min(seq.published, length // self.block_size)

    def _make_writable(self, seq: _Sequence, index: int) -> None:
        block = seq.blocks[index]
        if self.pool.holders(block) == 1:
            self.pool.unpublish(block)
            return
        copy = self.pool.allocate()
        size = self.block_size
        source, target = slice(block * size, (block + 1) * size), slice(copy * size, (copy + 1) * size)
        self.keys[:, :, target] = self.keys[:, :, source]
        self.values[:, :, target] = self.values[:, :, source]
        self.pool.release(block)
        seq.blocks[index] = copy

    # -- a forward ------------------------------------------------------------------------------------------
    def reserve(self, seq_id: Hashable, length: int) -> None:
        """Blocks for positions up to `length`; KVCacheFullError (nothing taken) when the pool lacks them."""
        seq = self._seqs[seq_id]
        needed = -(-length // self.block_size) - len(seq.blocks)
        if needed <= 0:  # most calls: a decode row's next tokens fit in its last block
            return
        if needed > self.pool.num_available():
            raise KVCacheFullError(
                f"the KV cache is full: {needed} more blocks needed, {self.pool.num_available()} available "
                f"of {self.pool.capacity_blocks} ({self.block_size} tokens each)"
            )
        for _ in range(needed):
            seq.blocks.append(self.pool.allocate(after=seq.blocks[-1] if seq.blocks else None))

    def slots(self, seq_id: Hashable, start: int, stop: int) -> list[int]:
        """Pool positions of the sequence's positions [start, stop) (their blocks reserved)."""
        blocks, size = self._seqs[seq_id].blocks, self.block_size
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def slot_array(self, seq_id: Hashable, start: int, stop: int) -> np.ndarray:
        """slots() as an int64 array, worked out in numpy: a read of kept states spans whole prompts (for an ask that
        opens 64 rows of 300 tokens, 2.9 ms a position at a time in Python against 0.4 ms in numpy, 2-core EPYC)."""
        positions = np.arange(start, stop, dtype=np.int64)
        return np.asarray(self._seqs[seq_id].blocks, dtype=np.int64)[positions // self.block_size] * self.block_size \
            + positions % self.block_size

    def append_tokens(self, seq_id: Hashable, tokens: Sequence[int], publish: bool = True) -> None:
        """The forward wrote `tokens` at the sequence's end; publish the blocks they filled. publish=False for a
        token tree, whose nodes are not a prefix of anything until keep_path has put one path in order."""
        seq = self._seqs[seq_id]
        seq.tokens.extend(tokens)
        if publish and seq.published < len(seq.tokens) // self.block_size:
            self._publish_full_blocks(seq)

    def _publish_full_blocks(self, seq: _Sequence) -> None:
        size = self.block_size
        while seq.published < len(seq.tokens) // size:
            index = seq.published
            previous = seq.blocks[index - 1] if index else None
            self.pool.publish(seq.blocks[index], self.pool.key(previous, seq.tokens[index * size : (index + 1) * size]))
            seq.published += 1

    def keep_path(self, seq_id: Hashable, start: int, path: Sequence[int]) -> None:
        """Keep, of the token tree fed at `start` (appended with publish=False), only the nodes `path` (indices
        among the fed tokens, increasing, as a root-to-node path is): each one's K/V in every layer (and its kept
        hidden state) moves to position start + k, and the sequence ends after the path, its full blocks
        published. The K/V of a node depend only on its ancestors, which the path holds, so they are exactly what
        feeding the path as a chain would have written."""
        seq = self._seqs[seq_id]
        fed = len(seq.tokens) - start
        if any(b <= a for a, b in zip(path, path[1:])) or (path and not 0 <= path[0] <= path[-1] < fed):
            raise ValueError(f"path {list(path)} is not an increasing list of the {fed} fed tokens")
        moves = [(k, j) for k, j in enumerate(path) if j != k]
        if moves:
            slots = self.slots(seq_id, start, start + fed)
            to_slots = torch.tensor([slots[k] for k, _ in moves], device=self.keys.device)
            from_slots = torch.tensor([slots[j] for _, j in moves], device=self.keys.device)
            # the right-hand side is a gathered copy, so no move overwrites a node another still reads
            self.keys[:, :, to_slots] = self.keys[:, :, from_slots]
            self.values[:, :, to_slots] = self.values[:, :, from_slots]
            if self.hidden is not None:
                self.hidden[to_slots] = self.hidden[from_slots]
        kept = [seq.tokens[start + j] for j in path]
        self.truncate(seq_id, start + len(path))
        seq.tokens[start:] = kept
        self._publish_full_blocks(seq)

    def row_read(self, seq_id: Hashable, span: int) -> torch.Tensor | slice:
        """Where to read the sequence's positions [0, span): a slice of the pool when its blocks lie in order
        (the usual case, see BlockPool.allocate), else an index of a layer's rows (_every_head)."""
        size = self.block_size
        blocks = self._seqs[seq_id].blocks[: -(-span // size)]
        if blocks[-1] - blocks[0] == len(blocks) - 1:
            return slice(blocks[0] * size, blocks[0] * size + span)
        positions = torch.arange(span)
        index = torch.tensor(blocks, dtype=torch.int64)[positions // size] * size + positions % size
        return self._every_head(index)

    def block_table(self, seq_ids: Sequence[Hashable], span: int, pad_rows: int = 0) -> torch.Tensor:
        """[rows + pad_rows, blocks covering span] each sequence's first blocks, on the host: what a forward needs to
        read positions [0, span) of every row (read_index). Past a sequence's blocks, and in the padding rows,
        the null block."""
        num_blocks = -(-span // self.block_size)
        # in numpy, filled through one mask: torch.tensor on a nested list took 190 us for 64 rows of 32 blocks
        # on a 2-core EPYC, a numpy row at a time 67, this 30
        table = np.full((len(seq_ids) + pad_rows, num_blocks), NULL_BLOCK, dtype=np.int64)
        held = [self._seqs[seq_id].blocks[:num_blocks] for seq_id in seq_ids]
        counts = np.fromiter(map(len, held), dtype=np.int64, count=len(held))
        table[: len(held)][np.arange(num_blocks) < counts[:, None]] = np.fromiter(
            chain.from_iterable(held), dtype=np.int64, count=int(counts.sum()))
        return torch.from_numpy(table)

    def table_slots(self, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Pool positions of sequence positions [rows, n] of a block table's rows ([rows, blocks], as block_table
        builds it): what slots() gives, for a batch at once. Positions past the table's blocks read its last
        column, so the caller masks them."""
        size = self.block_size
        columns = np.minimum(positions // size, table.shape[1] - 1)
        return np.take_along_axis(table, columns, axis=1) * size + positions % size

    def read_index(self, table: torch.Tensor, ends: torch.Tensor, span: int) -> torch.Tensor:
        """The index of a layer's rows (_every_head) that reads positions [0, span) of every row of a block table
        into one padded [kv_heads, rows * span] buffer; positions at or past a row's end ([rows]) read the null
        block. Tensor operations on the table's device alone, so a captured graph computes it: the host sends a
        block table, not an index of kv_heads x rows x span positions."""
        size = self.block_size
        positions = torch.arange(span, device=table.device)
        index = table[:, positions // size] * size + positions % size  # [rows, span]
        index = torch.where(positions[None, :] < ends[:, None], index, NULL_BLOCK * size)
        heads, slots = self.keys.shape[1], self.keys.shape[2]
        return (torch.arange(heads, device=table.device)[:, None] * slots + index.reshape(1, -1)).reshape(-1)

    def _every_head(self, index: torch.Tensor) -> torch.Tensor:
        """Pool positions -> rows of a layer's cache seen as [kv_heads * slots, head_dim], head-major: one
        gather along the first dimension (a row copy each), which is about a third cheaper on CPU than the same
        gather along the slot dimension of [kv_heads, slots, head_dim]."""
        heads, slots = self.keys.shape[1], self.keys.shape[2]
        return (torch.arange(heads)[:, None] * slots + index[None, :]).reshape(-1).to(self.keys.device)
