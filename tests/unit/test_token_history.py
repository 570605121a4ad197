"""token_history.py: the drafter service's committed tokens, read by proposers as a Sequence of ints or, through
numpy, as the buffer itself."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.token_history import TokenHistory, TokenView


def test_a_view_reads_as_a_sequence_of_ints_and_as_the_buffer_without_a_copy():
    history = TokenHistory([5, 6, 7])
    history.extend((8,))
    view = history.view()
    assert len(view) == 4 and list(view) == [5, 6, 7, 8] and tuple(view) == (5, 6, 7, 8)
    assert view[0] == 5 and type(view[-1]) is int
    assert list(view[1:3]) == [6, 7] and isinstance(view[1:3], TokenView)
    assert view == [5, 6, 7, 8] and view != [5, 6, 7] and view == (5, 6, 7, 8)
    array = np.asarray(view, dtype=np.int64)
    assert np.shares_memory(array, np.asarray(history.view()))  # the buffer itself, not a copy
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0] = 1
    assert np.array(view, dtype=np.int32).dtype == np.int32  # a copy in another dtype when asked


def test_a_view_is_a_snapshot_of_its_step():
    history = TokenHistory()
    assert len(history.view()) == 0 and list(history.view()) == []
    history.extend([1, 2])
    before = history.view()
    for token in range(200):  # grows the buffer several times
        history.extend([token])
    assert list(before) == [1, 2] and len(history) == 202
    assert list(history.view()[-3:]) == [197, 198, 199]
