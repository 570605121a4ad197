"""Prefix caching for the EAGLE head's own K/V: a new sequence whose committed tokens start like an earlier one's
takes that one's head cache for the shared full blocks and feeds only the rest, as the verifier's prefix cache
spares the target (and, now that it keeps hidden states beside K/V, for EAGLE requests too).

Head position t holds [embed(x_{t+1}); f_t], and f_t is the target's state after x_0..x_t, so the head's K/V of
positions in block b (t = 16b .. 16b+15) are fixed by the tokens x_0 .. x_{16b+16}. A block is keyed by its 17
tokens and the block before it (by id: ids are never reused, so a block whose predecessor was evicted can never
match again, as in block_pool.py). Blocks are copies, bounded in number and evicted least-recently-used: a
few tens of MB for a one-layer head. A wrong match is impossible; at worst a prefix is fed again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import count

import torch

BLOCK = 16
MAX_BLOCKS = 2048  # 32k positions; a SmolLM2 head's block is 24 KiB

HeadCache = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, kv_heads, positions, head_dim]


class HeadPrefixCache:
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._ids = count(1)
        self._id_of: dict[tuple[int, tuple[int, ...]], int] = {}
        self._blocks: OrderedDict[int, tuple[tuple[int, tuple[int, ...]], HeadCache]] = OrderedDict()
        self.hits = 0  # head positions taken from the cache instead of fed

    @staticmethod
    def _tokens(tokens: Sequence[int], block: int) -> tuple[int, ...]:
        return tuple(int(t) for t in tokens[block * BLOCK : (block + 1) * BLOCK + 1])

    def longest(self, tokens: Sequence[int], positions: int) -> tuple[int, HeadCache | None]:
        """The cached head K/V of the longest run of full blocks that starts `tokens`, covering at most
        `positions` head positions: (positions covered, the cache or None)."""
        found, previous = [], 0
        for block in range(positions // BLOCK):
            key = (previous, self._tokens(tokens, block))
            block_id = self._id_of.get(key)
            if block_id is None:
                break
            self._blocks.move_to_end(block_id)
            found.append(self._blocks[block_id][1])
            previous = block_id
        if not found:
            return 0, None
        self.hits += len(found) * BLOCK
        return len(found) * BLOCK, (torch.cat([k for k, _ in found], dim=2), torch.cat([v for _, v in found], dim=2))

    def publish(self, tokens: Sequence[int], cache: HeadCache, positions: int,
                since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """Keep the full blocks of a sequence's head cache (its first `positions` positions are fed). `since`:
        (blocks, id of the last) this sequence published before, which are not walked again; returns the same
        for the next call."""
        done, previous = since
        for block in range(done, positions // BLOCK):
            key = (previous, self._tokens(tokens, block))
            block_id = self._id_of.get(key)
            if block_id is None:
                block_id = next(self._ids)
                part = slice(block * BLOCK, (block + 1) * BLOCK)
                self._id_of[key] = block_id
                self._blocks[block_id] = (key, (cache[0][:, :, part].clone(), cache[1][:, :, part].clone()))
                while len(self._blocks) > self.max_blocks:
                    old_key, _ = self._blocks.popitem(last=False)[1]
                    del self._id_of[old_key]
            elif block_id in self._blocks:
                self._blocks.move_to_end(block_id)
            previous, done = block_id, block + 1
        return done, previous
