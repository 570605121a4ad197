"""token_history.py: committed tokens (the drafter service's, and the engine's for in-process proposers), read by
proposers as a Sequence of ints or, through numpy, as the buffer itself."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.token_history import TokenHistory, TokenView
from services.verifier.request_state import RequestState
from services.verifier.sampling_params import GenerationRequest, SamplingParams


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


def test_a_request_states_committed_view_follows_its_tokens_and_converts_only_the_new_ones():
    """What the engine hands its proposers (RequestState.committed_view): the request's tokens, caught up with the
    ones committed since the last view, each view a snapshot of its own step."""
    request = GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=8))
    state = RequestState(request, seed=0, token_ids=[1, 2, 3], outputs=asyncio.Queue())
    first = state.committed_view()
    assert first == [1, 2, 3]
    state.token_ids.append(4)
    state.token_ids.append(5)
    second = state.committed_view()
    assert second == [1, 2, 3, 4, 5] and first == [1, 2, 3]  # the earlier step's view is unchanged
    assert np.shares_memory(np.asarray(second), np.asarray(state.committed_view()))  # caught up in place
    assert state.committed_view() == state.token_ids
    state.token_ids = [1, 2]  # grew shorter (not something the engine does): read again whole
    assert state.committed_view() == [1, 2]
