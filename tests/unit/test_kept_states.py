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


def test_rows_are_copied_once_when_read_not_as_they_come(monkeypatch):
    """A step's rows stay views until the request is read (its drafter asked): a request never read copies none of
    them, and one read copies them in one go, in order, bit for bit; past MAX_PENDING steps they are copied too."""
    from services.common.growing_rows import GrowingRows
    from services.verifier import kept_states

    copies = []
    extend = GrowingRows.extend

    def counted(self, count, like):
        copies.append(count)
        return extend(self, count, like)

    monkeypatch.setattr(GrowingRows, "extend", counted)
    prefill = torch.randn(5, 8)
    kept = KeptStates(prefill)
    steps = [torch.randn(2, 3, 8) for _ in range(20 + kept_states.MAX_PENDING + 5)]  # each step's own tensor
    for step in steps[:20]:
        kept.append(StepStates(step).row(1, slice(2)))
    assert copies == [5] and len(kept) == 5 + 2 * 20  # a prefill's states are copied as they come
    assert torch.equal(kept.view(), torch.cat([prefill, *(step[1, :2] for step in steps[:20])]))
    assert copies == [5, 2 * 20]
    for step in steps[20:]:
        kept.append(StepStates(step).row(0, [0, 2]))
    assert copies[2:] == [2 * kept_states.MAX_PENDING]  # MAX_PENDING appends waited: copied in one, not a step each
    expected = torch.cat([prefill, *(s[1, :2] for s in steps[:20]), *(s[0, [0, 2]] for s in steps[20:])])
    assert torch.equal(kept.view(), expected) and len(kept) == expected.shape[0] and copies[3:] == [2 * 5]
