"""The q the verification reads: each sampled line's, padded, and none for greedy lines (which never read it)."""

import torch

from services.verifier.step_execution import draft_probabilities


def test_each_sampled_lines_q_is_padded_into_place_and_greedy_lines_are_left_out():
    vocab, max_k = 6, 3
    q_sampled = torch.softmax(torch.randn(2, vocab), dim=-1).half()  # as a remote drafter sends it
    q_greedy = torch.softmax(torch.randn(3, vocab), dim=-1)
    probs, has = draft_probabilities([2, 3, 0], [q_sampled, q_greedy, None], [False, True, False], max_k, vocab,
                                     torch.device("cpu"))
    assert has.tolist() == [True, False, False]
    assert probs.shape == (3, max_k, vocab) and probs.dtype == torch.float32
    torch.testing.assert_close(probs[0, :2], q_sampled.float())
    assert not probs[0, 2:].any() and not probs[1:].any()  # padding, the greedy line and the line without q


def test_no_q_is_sent_when_only_greedy_lines_have_one():
    q = torch.softmax(torch.randn(1, 4), dim=-1)
    assert draft_probabilities([1, 1], [q, None], [True, False], 1, 4, torch.device("cpu")) == (None, None)
