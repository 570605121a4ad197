"""Prefix caching for the EAGLE head's own K/V: a new sequence whose committed tokens start like an earlier one's
takes that one's head cache for the shared full blocks and feeds only the rest, as the verifier's prefix cache
spares the target (and, now that it keeps hidden states beside K/V, for EAGLE requests too).

Head position t holds [embed(x_{t+1}); f_t], and f_t is the target's state after x_0..x_t, so the head's K/V of
positions in block b (t = 16b .. 16b+15) are fixed by the tokens x_0 .. x_{16b+16}. A block is keyed by its 17
tokens and the block before it (by id: ids are never reused, so a block whose predecessor was evicted can never
match again, as in block_pool.py). Blocks are bounded in number and evicted least-recently-used: a few tens of MB
for a one-layer head. A wrong match is impossible; at worst a prefix is fed again.

The blocks live in one pool per K and V ([slots, BLOCK, kv heads, D], position-major as a sequence's own head
cache is), grown by doubling up to max_blocks, and every sequence of a call publishes its new blocks in one copy
(`index_copy_` of their runs). Why: a clone per block was most of an EAGLE ask's opening on a GPU's host: at 52
new sequences of 100 tokens, 624 clones and as many slices of 2,394 tensor operations (stop 74, H200: an opening
at 64 chats took 53 ms against a 7 ms step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

import torch

from services.modeling.host_copies import to_device

BLOCK = 16
MAX_BLOCKS = 2048  # 32k positions; a SmolLM2 head's block is 24 KiB in float32
MIN_SLOTS = 64  # the pool's first size, doubled when full

BlockKey = tuple[int, tuple[int, ...]]  # (the id of the block before, its 17 tokens)
HeadRows = tuple[torch.Tensor, torch.Tensor]  # keys, values: [positions, kv heads, D], as HeadSequence holds them


@dataclass
class Publication:
    """One sequence's part in a publish call: its tokens, its head cache's rows, how many positions are fed, and
    (blocks, id of the last) it published before, which are not walked again."""

    tokens: Sequence[int]
    rows: HeadRows
    positions: int
    since: tuple[int, int] = (0, 0)


class HeadPrefixCache:
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._ids = count(1)
        self._id_of: dict[BlockKey, int] = {}
        self._blocks: OrderedDict[int, tuple[BlockKey, int]] = OrderedDict()  # block id -> (its key, its slot)
        self._free: list[int] = []  # slots of the pool no block holds
        self._pool: HeadRows | None = None  # [slots, BLOCK, kv heads, D] each, made like the first rows published
        self.hits = 0  # head positions taken from the cache instead of fed

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def _tokens(tokens: Sequence[int], block: int) -> tuple[int, ...]:
        return tuple(int(t) for t in tokens[block * BLOCK : (block + 1) * BLOCK + 1])

    def longest(self, tokens: Sequence[int], positions: int) -> tuple[int, HeadRows | None]:
        """The cached head K/V rows of the longest run of full blocks that starts `tokens`, covering at most
        `positions` head positions: (positions covered, copies of the rows or None)."""
        slots, previous = [], 0
        for block in range(positions // BLOCK):
            block_id = self._id_of.get((previous, self._tokens(tokens, block)))
            if block_id is None:
                break
            self._blocks.move_to_end(block_id)
            slots.append(self._blocks[block_id][1])
            previous = block_id
        if not slots:
            return 0, None
        self.hits += len(slots) * BLOCK
        keys, values = self._pool
        index = to_device(torch.tensor(slots), keys.device)
        return len(slots) * BLOCK, (keys[index].flatten(0, 1), values[index].flatten(0, 1))

    def publish(self, publications: Sequence[Publication]) -> list[tuple[int, int]]:
        """Keep the new full blocks of each sequence's head cache, all in one copy; returns each one's (blocks, id
        of the last) for its next call. A block another sequence published already is shared, not copied. Slots
        are never reused within a call (two copies to one slot would race), so a call holding more new blocks than
        the cache does publishes the first max_blocks of them."""
        runs, slots, taken, progress = [], [], set(), []
        for publication in publications:
            done, previous = publication.since
            for block in range(done, publication.positions // BLOCK):
                key = (previous, self._tokens(publication.tokens, block))
                block_id = self._id_of.get(key)
                if block_id is None:
                    slot = self._slot(publication.rows, taken)
                    if slot is None:
                        break
                    block_id = next(self._ids)
                    self._id_of[key] = block_id
                    self._blocks[block_id] = (key, slot)
                    taken.add(slot)
                    slots.append(slot)
                    _extend_run(runs, publication.rows, block)
                elif block_id in self._blocks:
                    self._blocks.move_to_end(block_id)
                previous, done = block_id, block + 1
            progress.append((done, previous))
        if slots:
            index = to_device(torch.tensor(slots), self._pool[0].device)
            for pool, part in zip(self._pool, range(2), strict=True):
                new = [rows[part][start * BLOCK : end * BLOCK] for rows, start, end in runs]
                pool.index_copy_(0, index, torch.cat(new).unflatten(0, (-1, BLOCK)))
        return progress

    def _slot(self, like: HeadRows, taken: set[int]) -> int | None:
        """A free slot of the pool (grown, or the least recently used block's, evicted); None when every slot is
        taken by this call's own blocks."""
        if not self._free:
            size = 0 if self._pool is None else self._pool[0].shape[0]
            if size < self.max_blocks:
                self._grow(like, min(max(2 * size, MIN_SLOTS), self.max_blocks))
            else:
                oldest = next(iter(self._blocks.values()), None)
                if oldest is None or oldest[1] in taken:
                    return None
                key, slot = self._blocks.popitem(last=False)[1]
                del self._id_of[key]
                self._free.append(slot)
        return self._free.pop()

    def _grow(self, like: HeadRows, size: int) -> None:
        old = 0 if self._pool is None else self._pool[0].shape[0]
        pool = tuple(rows.new_zeros(size, BLOCK, *rows.shape[1:]) for rows in like)
        if self._pool is not None:
            for new, current in zip(pool, self._pool, strict=True):
                new[:old] = current
        self._pool = pool
        self._free.extend(range(size - 1, old - 1, -1))  # popped lowest first


def _extend_run(runs: list[tuple[HeadRows, int, int]], rows: HeadRows, block: int) -> None:
    """Add `block` of `rows` to the runs to copy: to the last run where it follows it, else as a run of its own."""
    if runs and runs[-1][0] is rows and runs[-1][2] == block:
        runs[-1] = (rows, runs[-1][1], block + 1)
    else:
        runs.append((rows, block, block + 1))
