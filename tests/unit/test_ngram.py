import numpy as np
import pytest

from services.common.proposer import DraftInput
from services.drafter.methods.ngram import NgramProposer, NgramSettings, propose_ngram


def lookup(tokens, k, lo=1, hi=4):
    return propose_ngram(np.array(tokens), k, NgramSettings(lo, hi))


def test_proposes_what_followed_the_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 6, 7]
    # suffix [6, 7] occurs at 1 and 6; the most recent earlier occurrence (6) is followed by 3, 6, 7
    assert lookup(tokens, 3) == [3, 6, 7]
    # a longer suffix [9, 1, 6, 7] would win if it existed; here n=3 [3, 6, 7] does not occur earlier
    assert lookup(tokens + [8], 2, hi=3) == [9, 1]  # suffix [6, 7, 8] matches at 1 -> followed by 9, 1


def test_respects_min_and_k():
    tokens = [1, 2, 3, 4, 2]
    assert lookup(tokens, 2, lo=1) == [3, 4]
    assert lookup(tokens, 2, lo=2) == []  # no earlier [4, 2]
    assert lookup(tokens, 0) == []
    assert lookup([7], 3) == []


def test_continuation_may_be_shorter_than_k():
    assert lookup([4, 4, 4], 5) == [4]


def test_settings_are_validated():
    with pytest.raises(ValueError):
        NgramSettings(3, 2)
    with pytest.raises(ValueError):
        NgramSettings(0, 2)


async def test_proposer_answers_each_input_in_order():
    proposer = NgramProposer(NgramSettings(1, 3))
    drafts = await proposer.propose([DraftInput("a", [1, 2, 1], 2), DraftInput("b", [9, 8], 2)])
    assert [list(d.token_ids) for d in drafts] == [[2, 1], []]
