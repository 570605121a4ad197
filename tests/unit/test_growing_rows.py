"""GrowingRows: appended rows read back as one array, without the history being copied on every append."""

import numpy as np
import pytest
import torch

from services.common.growing_rows import MIN_CAPACITY, GrowingRows


@pytest.mark.parametrize("make", [lambda n: torch.randn(n, 3), lambda n: np.random.rand(n, 3).astype(np.float16)],
                         ids=["torch", "numpy"])
def test_appended_chunks_read_back_in_order(make):
    chunks = [make(n) for n in (5, 1, 0, 2, 130, 1)]
    rows = GrowingRows()
    assert rows.view() is None and len(rows) == 0
    for chunk in chunks:
        rows.append(chunk)
    expected = np.concatenate([np.asarray(c) for c in chunks])
    assert len(rows) == len(expected)
    np.testing.assert_array_equal(np.asarray(rows.view()), expected)
    assert type(rows.view()) is type(chunks[0]) and rows.view().dtype == chunks[0].dtype


def test_a_view_keeps_its_rows_after_later_appends_even_across_a_regrowth():
    rows = GrowingRows(torch.arange(6.0).reshape(3, 2))
    before = rows.view()
    rows.append(torch.full((1, 2), -1.0))  # within capacity: written past the view's rows
    rows.append(torch.full((MIN_CAPACITY * 3, 2), -2.0))  # a new buffer
    assert torch.equal(before, torch.arange(6.0).reshape(3, 2))
    assert torch.equal(rows.view()[:3], before) and rows.view()[3, 0] == -1.0


def test_appends_cost_amortised_constant_copies_not_the_history_each_time():
    """One row a step for 4,096 steps: the buffer is reallocated O(log n) times, so the rows copied in all stay
    within a small multiple of n (a concatenation per step copies n^2 / 2 of them)."""
    rows = GrowingRows()
    buffers = set()
    for step in range(4096):
        rows.append(torch.full((1, 2), float(step)))
        buffers.add(rows.view().data_ptr())
    assert len(buffers) <= 8  # 64 -> 128 -> ... -> 4096
    assert torch.equal(rows.view()[:, 0], torch.arange(4096.0))


def test_extended_rows_are_written_in_place_by_the_caller_and_grow_like_appends():
    """extend(count) counts the rows in and hands back their place in the buffer (a drafter fills many sequences'
    places in one grouped copy): written there, they read back as appended ones, across a regrowth too."""
    rows, expected = GrowingRows(), []
    for start in range(0, 3 * MIN_CAPACITY, 24):
        chunk = torch.arange(start, start + 24, dtype=torch.float32)[:, None].expand(24, 3)
        place = rows.extend(24, chunk)
        assert place.shape == (24, 3) and len(rows) == start + 24
        torch._foreach_copy_([place], [chunk])
        expected.append(chunk)
    assert torch.equal(rows.view(), torch.cat(expected))


def test_the_first_rows_get_room_for_as_many_again_so_the_next_appends_copy_nothing():
    """A prompt's rows, then a step's: the buffer made for the first rows takes the next ones in place."""
    rows = GrowingRows(torch.zeros(3 * MIN_CAPACITY, 2))
    buffer = rows.view().data_ptr()
    for _ in range(3 * MIN_CAPACITY):
        rows.append(torch.ones(1, 2))
    assert rows.view().data_ptr() == buffer and len(rows) == 6 * MIN_CAPACITY
