"""The EAGLE head's prefix cache (services/drafter/head_prefix_cache.py): blocks kept in one pool, published in one
copy a call, read back exactly, shared between sequences, evicted least-recently-used, never a wrong match."""

import torch

from services.drafter.head_prefix_cache import BLOCK, MIN_SLOTS, HeadPrefixCache, Publication

KV_HEADS, HEAD_DIM = 2, 4


def head_rows(positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(positions, KV_HEADS, HEAD_DIM, generator=generator),
            torch.randn(positions, KV_HEADS, HEAD_DIM, generator=generator))


def test_blocks_of_many_sequences_publish_in_one_call_and_read_back_exactly_across_pool_growth():
    cache = HeadPrefixCache()
    sequences = {seed: (list(range(seed * 1000, seed * 1000 + 150)), head_rows(149, seed)) for seed in range(12)}
    progress = cache.publish([Publication(tokens, rows, 149) for tokens, rows in sequences.values()])
    assert progress[0][0] == 149 // BLOCK and len(cache) == 12 * (149 // BLOCK) > MIN_SLOTS  # the pool grew
    for tokens, rows in sequences.values():
        covered, found = cache.longest(tokens, 149)
        assert covered == 144
        assert torch.equal(found[0], rows[0][:144]) and torch.equal(found[1], rows[1][:144])


def test_a_sequence_publishes_only_its_new_blocks_and_a_shared_prefix_is_kept_once():
    cache = HeadPrefixCache()
    shared = list(range(40))
    first, second = shared + [1, 2, 3], shared + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    rows_first, rows_second = head_rows(42, 1), head_rows(49, 2)
    rows_second[0][:32], rows_second[1][:32] = rows_first[0][:32], rows_first[1][:32]  # the same prefix's K/V
    done = cache.publish([Publication(first, rows_first, 20)])[0]
    assert done[0] == 1 and len(cache) == 1
    done = cache.publish([Publication(first, rows_first, 42, done)])[0]  # from block 1 on
    assert done[0] == 2 and len(cache) == 2
    cache.publish([Publication(second, rows_second, 49)])  # blocks 0-1 shared, block 2 its own
    assert len(cache) == 3
    covered, found = cache.longest(second, 48)
    assert covered == 48 and torch.equal(found[0], rows_second[0][:48])


def test_the_least_recently_used_block_is_evicted_and_its_slot_holds_the_new_one():
    cache = HeadPrefixCache(max_blocks=4)
    a, b = list(range(100, 165)), list(range(200, 265))  # 4 full blocks each (64 positions)
    rows_a, rows_b = head_rows(64, 1), head_rows(64, 2)
    cache.publish([Publication(a, rows_a, 64)])
    assert cache.longest(a, 16)[0] == 16  # block 0 of a used last: evicted last
    cache.publish([Publication(b, rows_b, 32)])  # two of a's blocks (1 and 2) make room
    assert len(cache) == 4
    assert cache.longest(a, 64)[0] == 16  # its block 1 is gone, so no run past block 0 matches
    covered, found = cache.longest(b, 32)
    assert covered == 32 and torch.equal(found[1], rows_b[1][:32])


def test_a_call_with_more_new_blocks_than_the_cache_holds_publishes_what_fits_and_matches_nothing_wrong():
    cache = HeadPrefixCache(max_blocks=3)
    tokens, rows = list(range(81)), head_rows(80, 3)  # 5 blocks
    done, _ = cache.publish([Publication(tokens, rows, 80)])[0]
    assert done == 3 and len(cache) == 3  # no slot taken twice in one call
    covered, found = cache.longest(tokens, 80)
    assert covered == 48 and torch.equal(found[0], rows[0][:48])
    other = list(range(500, 581))
    cache.publish([Publication(other, head_rows(80, 4), 80)])  # evicts the first sequence's blocks
    assert cache.longest(tokens, 80) == (0, None)
