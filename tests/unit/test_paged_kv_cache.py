"""The paged KV pool's bookkeeping: blocks taken as tokens arrive and given back on rollback and removal, prefix
matching that is exact (a block's key names its whole prefix), least-recently-used eviction, copy-on-write when a
rollback lands in a block another sequence shares, blocks kept in order; and the budget that sizes the pool."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from services.common.byte_size import parse_bytes
from services.modeling.block_pool import NULL_BLOCK, BlockPool, KVCacheFullError
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.paged_kv_cache import PagedKVCache
from tests.memory import resident_bytes

SIZE = 4


def cache(num_blocks: int = 16, prefix: bool = True) -> PagedKVCache:
    return PagedKVCache(1, 1, 2, num_blocks, SIZE, torch.float32, torch.device("cpu"), prefix)


def feed(kv: PagedKVCache, seq, tokens) -> None:
    """What a forward does: blocks for the new positions, K/V written (the token id as the value), tokens kept."""
    start = kv.length(seq)
    kv.reserve(seq, start + len(tokens))
    slots = kv.slots(seq, start, start + len(tokens))
    kv.keys[0, 0, slots] = torch.tensor(tokens, dtype=torch.float32)[:, None]
    kv.append_tokens(seq, tokens)


def stored(kv: PagedKVCache, seq) -> list[int]:
    read = kv.row_read(seq, kv.length(seq))
    return [int(x) for x in kv.keys[0, 0, read][:, 0]]


def test_blocks_follow_the_tokens_and_come_back():
    kv = cache()
    kv.add("a")
    feed(kv, "a", list(range(10)))
    assert kv.blocks_needed("a", 10) == 0 and kv.pool.num_available() == 15 - 3
    kv.truncate("a", 5)  # rollback: the third block goes back
    assert kv.pool.num_available() == 15 - 2 and stored(kv, "a") == [0, 1, 2, 3, 4]
    kv.remove("a")
    assert kv.pool.num_available() == 15  # published blocks stay cached but count as available


def test_a_sequence_blocks_stay_in_order_so_attention_reads_a_view():
    kv = cache(64)
    for seq in ("a", "b", "c"):
        kv.add(seq)
    for step in range(6):  # the three grow in turns, as decode steps do
        for seq in ("a", "b", "c"):
            feed(kv, seq, [step * 10 + len(seq)] * 3)
    for seq in ("a", "b", "c"):
        assert isinstance(kv.row_read(seq, kv.length(seq)), slice), kv._seqs[seq].blocks
        assert len(stored(kv, seq)) == 18


def test_the_longest_cached_prefix_is_reused_and_never_a_prompt_whole():
    kv = cache()
    kv.add("a")
    feed(kv, "a", list(range(1, 14)))  # 3 full blocks, 1 partial
    kv.add("b", list(range(1, 14)))
    assert kv.length("b") == 12  # the prompt's full blocks; its last token is computed
    kv.add("c", list(range(1, 13)))
    assert kv.length("c") == 8  # 12 tokens: the third block holds the last one, so it is computed
    kv.add("d", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert kv.length("d") == 4  # the match stops at the first differing block
    kv.add("e", [2, 3, 4, 5, 6])
    assert kv.length("e") == 0  # a block's key names everything before it
    assert kv.pool.stats.hits == 12 + 8 + 4 and kv.pool.stats.queries == 13 + 12 + 9 + 5
    assert stored(kv, "b") == list(range(1, 13))


def test_without_prefix_caching_nothing_matches():
    kv = cache(prefix=False)
    kv.add("a")
    feed(kv, "a", list(range(1, 14)))
    kv.add("b", list(range(1, 14)))
    assert kv.length("b") == 0 and kv.pool.stats.queries == 13 and kv.pool.stats.hits == 0


def test_cached_blocks_are_evicted_least_recently_used_first():
    kv = cache(num_blocks=5)  # 4 usable blocks
    for seq, first in (("a", 100), ("b", 200)):
        kv.add(seq)
        feed(kv, seq, [first + i for i in range(2 * SIZE)])
        kv.remove(seq)  # its two full blocks stay cached
    kv.add("a2", [100 + i for i in range(2 * SIZE + 1)])  # uses a's blocks again: now b's are the oldest
    kv.add("c")
    feed(kv, "c", [300] * SIZE * 2)  # needs two blocks: both of b's are evicted, a's stay
    kv.add("b2", [200 + i for i in range(2 * SIZE + 1)])
    kv.add("a3", [100 + i for i in range(2 * SIZE + 1)])
    assert kv.length("b2") == 0 and kv.length("a3") == 2 * SIZE


def test_a_full_pool_refuses_without_taking_anything():
    kv = cache(num_blocks=3)
    kv.add("a")
    feed(kv, "a", [1] * SIZE)
    with pytest.raises(KVCacheFullError):
        kv.reserve("a", 3 * SIZE)
    assert kv.pool.num_available() == 1 and kv.blocks_needed("a", 3 * SIZE) == 2


def test_rollback_into_a_shared_block_copies_it_and_leaves_the_cached_one_intact():
    kv = cache()
    kv.add("a")
    feed(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.add("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # holds a's two full blocks
    shared = kv._seqs["b"].blocks[1]
    kv.truncate("b", 6)  # b now writes into its second block: it gets a copy
    assert kv._seqs["b"].blocks[1] != shared and kv.pool.holders(shared) == 1
    feed(kv, "b", [60, 70])
    assert stored(kv, "b") == [1, 2, 3, 4, 5, 6, 60, 70] and stored(kv, "a")[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    kv.add("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.length("c") == 8 and stored(kv, "c") == [1, 2, 3, 4, 5, 6, 7, 8]


def test_rollback_into_an_unshared_published_block_unpublishes_it():
    kv = cache()
    kv.add("a")
    feed(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    kv.truncate("a", 6)
    feed(kv, "a", [60, 70])  # overwrites the block that held 5..8
    kv.add("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.length("b") == 4, "the overwritten block must not match its old tokens"
    kv.add("c", [1, 2, 3, 4, 5, 6, 60, 70, 9])
    assert kv.length("c") == 8


def test_an_evicted_block_never_matches_as_the_parent_of_another():
    pool = BlockPool(3, SIZE)  # 2 usable blocks
    first = pool.allocate()
    pool.publish(first, pool.key(None, [1, 1, 1, 1]))
    second = pool.allocate(after=first)
    pool.publish(second, pool.key(first, [2, 2, 2, 2]))
    pool.release(first)
    pool.release(second)
    reused = pool.allocate()  # evicts the least recently used: `first`, whose id comes back with other content
    assert reused == first
    pool.publish(reused, pool.key(None, [7, 7, 7, 7]))
    assert len(pool.match([7, 7, 7, 7, 2, 2, 2, 2, 0], 2)) == 1, "second's key named the old `first`"


def test_padding_reads_the_null_block_which_stays_zero():
    kv = cache()
    kv.add("a")
    kv.add("b")
    feed(kv, "a", [5] * 6)
    feed(kv, "b", [6] * 2)
    index = kv.read_index(kv.block_table(["a", "b"], 6, pad_rows=1), torch.tensor([6, 2, 0]), 6).view(3, 6)
    assert (index[2] == NULL_BLOCK * SIZE).all()
    assert (index[1, 2:] == NULL_BLOCK * SIZE).all() and kv.keys[0, 0, NULL_BLOCK * SIZE].abs().sum() == 0


def test_the_budget_sizes_the_pool():
    per_token = PagedKVCache.bytes_per_token(2, 2, 8, torch.float32)
    assert per_token == 2 * 2 * 2 * 8 * 4
    config = KVCacheConfig(memory_bytes=per_token * 16 * 10, block_size=16)
    assert config.num_blocks(per_token, 64, 8, torch.device("cpu")) == 10 + 1
    with pytest.raises(ValueError, match="fewer than one sequence"):
        KVCacheConfig(memory_bytes=per_token * 16, block_size=16).num_blocks(per_token, 64, 8, torch.device("cpu"))
    default = KVCacheConfig(block_size=16).num_blocks(per_token, 64, 8, torch.device("cpu"))
    assert default == 2 * 8 * 4 + 1  # at most twice what max_num_seqs full sequences fill
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512M") == 512 * 10**6 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_gpu_memory_utilization_leaves_the_rest_of_the_device_to_others(monkeypatch):
    """vLLM's --gpu-memory-utilization u: the pool takes what is free beyond the (1 - u) of the device's memory left
    to others, uncapped; too little for one sequence is an error that names the flag; a byte budget wins."""
    from services.modeling import kv_budget

    per_token, cpu = PagedKVCache.bytes_per_token(2, 2, 8, torch.float32), torch.device("cpu")
    block = per_token * 16
    monkeypatch.setattr(kv_budget, "total_memory", lambda device: 1000 * block)
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 600 * block)  # 400 blocks' worth held already
    assert KVCacheConfig(block_size=16, memory_utilization=0.9).num_blocks(per_token, 64, 8, cpu) == 500 + 1
    assert KVCacheConfig(block_size=16, memory_utilization=0.5).num_blocks(per_token, 64, 8, cpu) == 100 + 1
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.4 leaves 0 bytes"):
        KVCacheConfig(block_size=16, memory_utilization=0.4).num_blocks(per_token, 64, 8, cpu)
    both = KVCacheConfig(memory_bytes=10 * block, block_size=16, memory_utilization=0.9)
    assert both.num_blocks(per_token, 64, 8, cpu) == 10 + 1
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            KVCacheConfig(memory_utilization=bad)


def test_the_devices_memory_is_read_from_the_device():
    from services.modeling.kv_budget import available_memory, total_memory

    cpu = torch.device("cpu")
    assert 0 < available_memory(cpu) <= total_memory(cpu)


def test_the_pool_is_resident_from_the_start():
    """An untouched CPU allocation is address space only: another process would size its pool from memory this
    one has already promised. Made, the pool is resident (a 256 MiB pool here): counted page by page on the pool's
    own bytes (mincore), since the process's total also moves with whatever else is freed meanwhile (a collection of
    earlier tests' garbage once hid half of it), and the Rss of the smaps mapping that holds a tensor's first byte
    once read half the pool late in a full run (there a large allocation may reuse heap pages freed by earlier tests,
    already resident: the pool is then resident either way, and only a fresh one tests the zeroing)."""
    with mmap.mmap(-1, 64 * 2**20) as untouched:  # fresh anonymous pages: the same measure sees them as not resident
        address = ctypes.addressof(ctypes.c_char.from_buffer(untouched))
        assert resident_bytes(address, len(untouched)) < 0.5 * len(untouched)
        untouched[:: mmap.PAGESIZE] = b"\1" * (len(untouched) // mmap.PAGESIZE)  # and written, as resident
        assert resident_bytes(address, len(untouched)) == len(untouched)
    pool = PagedKVCache(4, 2, 64, 4096, 16, torch.float32, torch.device("cpu"))
    grown = resident_bytes(pool.keys.data_ptr(), pool.keys.nbytes) + resident_bytes(pool.values.data_ptr(),
                                                                                   pool.values.nbytes)
    sink = 2 * 4 * 2 * 16 * 64 * 4  # the one block past the pool's that a padded batch writes its padding to
    assert pool.keys.nbytes + pool.values.nbytes == 256 * 2**20 + sink
    assert grown >= 0.95 * 256 * 2**20, grown


def test_kept_states_are_read_from_each_ranges_slots_in_order():
    """hidden_states_of: the positions of several sequences' ranges (slot_array, worked out in numpy) gathered in
    one read, in order, across block boundaries and blocks out of order in the pool."""
    kv = cache(num_blocks=16)
    kv.keep_hidden_states(3, torch.float32)
    kv.add("a")
    kv.add("b")
    for turn in range(3):  # the two sequences take their blocks in turn: neither's are contiguous
        for seq, base in (("a", 100), ("b", 200)):
            start = kv.length(seq)
            feed(kv, seq, list(range(start, start + 5)))
            slots = kv.slots(seq, start, start + 5)
            kv.hidden[slots] = torch.tensor([base + p for p in range(start, start + 5)], dtype=torch.float32)[:, None]
    for seq in ("a", "b"):
        for start, stop in ((0, 15), (3, 9), (7, 7), (12, 15)):
            assert kv.slot_array(seq, start, stop).tolist() == kv.slots(seq, start, stop)
    read = kv.hidden_states_of([("b", 2, 6), ("a", 0, 0), ("a", 3, 13)])
    assert read[:, 0].tolist() == [202, 203, 204, 205, *range(103, 113)] and read.shape == (14, 3)
    assert kv.hidden_states_of([("a", 0, 4)])[:, 2].tolist() == [100, 101, 102, 103]
