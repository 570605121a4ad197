"""A request's kept hidden states: appended as numpy bits, read back as tensors of their own dtype, bit for bit."""

from __future__ import annotations

import pytest
import torch

from services.verifier.kept_states import KeptStates, StepStates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_states_come_back_bit_for_bit_in_their_dtype(dtype):
    prefill = torch.randn(7, 12).to(dtype)
    kept = KeptStates(prefill)
    step = torch.randn(3, 5, 12).to(dtype)  # rows x width x H, as a step hands them over
    states = StepStates(step)
    kept.append(states.row(1, slice(2)))  # a chain's [last committed, one accepted draft]
    kept.append(states.row(1, [0, 2, 4]))  # a tree's path: positions apart
    kept.append(states.row(2, [1, 2, 3]))  # a run of positions, taken as a view
    view = kept.view()
    assert view.dtype == dtype and view.shape == (7 + 2 + 3 + 3, 12) and len(kept) == 15
    expected = torch.cat([prefill, step[1, :2], step[1, [0, 2, 4]], step[2, 1:4]])
    assert torch.equal(view.view(torch.uint8), expected.view(torch.uint8))


def test_a_view_survives_later_appends_and_other_dtypes_are_refused():
    kept = KeptStates()
    assert kept.view() is None and len(kept) == 0
    kept.append(torch.ones(2, 4, dtype=torch.bfloat16))
    first = kept.view()
    for _ in range(100):  # the buffer grows past its first capacity
        kept.append(torch.full((1, 4), 2.0, dtype=torch.bfloat16))
    assert torch.equal(first, torch.ones(2, 4, dtype=torch.bfloat16)) and len(kept) == 102
    with pytest.raises(ValueError, match="float32"):
        kept.append(torch.ones(1, 4))
