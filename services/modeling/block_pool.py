"""Which KV blocks are free, who holds them, and which full blocks can be reused by content (prefix caching).

Pure bookkeeping, no tensors: paged_kv_cache.py owns the memory and asks this pool for block ids.

Prefix caching follows vLLM's automatic prefix caching: a full block is keyed by its tokens and by the block
before it, so a key names the whole prefix up to the block's end. The key holds the previous block's id and
generation (bumped each time a block is reused for other content) instead of a hash of it, so a lookup is exact:
no two prefixes share a key, and a key whose previous block was evicted can never match again. A block nobody
holds stays cached (evictable) until a new allocation needs it, least recently used first.

Block 0 is never handed out: it stays zero and is what padded positions of a batch read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = 0

BlockKey = tuple[int, int, tuple[int, ...]]  # (previous block id, its generation, this block's tokens)


class KVCacheFullError(RuntimeError):
    """No free block is left in the KV pool (the engine plans steps so that this does not happen)."""


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and tokens found, since start (vLLM's prefix_cache_queries
    and prefix_cache_hits)."""

    queries: int = 0
    hits: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._refs = [0] * num_blocks
        self._generation = [0] * num_blocks
        self._key_of: dict[int, BlockKey] = {}  # cached (full, keyed) blocks
        self._block_of: dict[BlockKey, int] = {}
        self._free = set(range(NULL_BLOCK + 1, num_blocks))  # held by nobody, keyed by nothing
        self._is_free = bytearray(b"\x01" * num_blocks)  # the same as flags, for finding runs
        self._is_free[NULL_BLOCK] = 0
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, held by nobody; oldest first

    # -- capacity -------------------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    def num_cached(self) -> int:
        return len(self._key_of)

    # -- holding blocks -------------------------------------------------------------------------------------
    def allocate(self, after: int | None = None) -> int:
        """A block for new content, held once: the block right after `after` (a sequence's last block) when
        nobody holds it, so that a sequence's blocks stay in order and attention reads them as a view; else the
        middle of the longest run of free blocks (a new sequence, or one that ran into another), so that
        sequences placed apart can each grow in place; cached blocks nobody holds count as free when no block
        is, the least recently used first."""
        block = None
        if after is not None and after + 1 < self.num_blocks and self._refs[after + 1] == 0:
            block = after + 1
        elif self._free:
            block = self._middle_of_longest_free_run()
        elif self._evictable:
            block = next(iter(self._evictable))
        if block is None:
            raise KVCacheFullError(f"the KV cache is full ({self.capacity_blocks} blocks of {self.block_size})")
        self._take(block)
        return block

    def _take(self, block: int) -> None:
        if block in self._key_of:
            del self._evictable[block]
            self._forget(block)
        else:
            self._free.remove(block)
            self._is_free[block] = 0
        self._refs[block] = 1

    def _middle_of_longest_free_run(self) -> int:
        flags = self._is_free  # bytes operations: scans at C speed, however fragmented the pool is
        longest = max(map(len, flags.split(b"\x00")))
        start = flags.find(b"\x01" * longest)  # the first run that long is a longest one
        return start + longest // 2 if longest > 2 else start

    def hold(self, block: int) -> None:
        """One more holder of a cached block (a prefix hit)."""
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if block in self._key_of:
            self._evictable[block] = None  # most recently used last
        else:
            self._free.add(block)
            self._is_free[block] = 1

    def holders(self, block: int) -> int:
        return self._refs[block]

    # -- prefix caching -------------------------------------------------------------------------------------
    def key(self, previous: int | None, tokens: Sequence[int]) -> BlockKey:
        if previous is None:
            return (NULL_BLOCK, -1, tuple(tokens))
        return (previous, self._generation[previous], tuple(tokens))

    def publish(self, block: int, key: BlockKey) -> None:
        """Make a full block findable by its key (the first block with a key keeps it)."""
        if not self.enable_prefix_caching or block in self._key_of or key in self._block_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block

    def unpublish(self, block: int) -> None:
        """Its holder is about to overwrite part of it (speculative rollback into a full block)."""
        if block in self._key_of:
            self._forget(block)

    def forget_all(self) -> None:
        """No block is findable by content any more; the ones nobody holds are free again."""
        for block in list(self._evictable):
            del self._evictable[block]
            self._forget(block)
            self._free.add(block)
            self._is_free[block] = 1
        for block in list(self._key_of):
            self._forget(block)

    def match(self, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """The cached blocks that hold the longest prefix of `tokens`, at most `max_blocks`, each held once
        more by the caller. Counts the query in `stats`."""
        size = self.block_size
        self.stats.queries += len(tokens)
        found: list[int] = []
        if not self.enable_prefix_caching:
            return found
        previous = None
        for index in range(min(max_blocks, len(tokens) // size)):
            block = self._block_of.get(self.key(previous, tokens[index * size : (index + 1) * size]))
            if block is None:
                break
            self.hold(block)
            found.append(block)
            previous = block
        self.stats.hits += len(found) * size
        return found

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
        self._generation[block] += 1  # keys naming this block as their previous one can never match again
