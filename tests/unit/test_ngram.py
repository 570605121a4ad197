import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def reference_continuations(tokens: list[int], lo: int, hi: int) -> list[int]:
    """The rule spelled out: for n from hi down to lo, the earlier occurrences of the last n tokens (they may overlap
    them, not be them); where what followed each starts, most recent first."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [j + n for j in range(len(tokens) - n) if tokens[j : j + n] == suffix]
        if starts:
            return starts[::-1]
    return []


def reference_lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    starts = reference_continuations(tokens, lo, hi)
    return tokens[starts[0] : starts[0] + k] if starts and k > 0 else []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 6), st.integers(1, 5), st.integers(0, 4))
def test_the_lookup_follows_the_rule_on_any_sequence(tokens, k, lo, extra):
    """Small alphabets, so that matches of every length, overlapping ones and ties between lengths are common."""
    from services.drafter.methods.ngram import _longest_match_starts

    assert lookup(tokens, k, lo, lo + extra) == reference_lookup(tokens, k, lo, lo + extra)
    starts = _longest_match_starts(np.array(tokens, dtype=np.int64), NgramSettings(lo, lo + extra))
    assert starts.tolist() == reference_continuations(tokens, lo, lo + extra)  # the trees' continuations


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 256, 257, 65536, 1 << 24, (1 << 24) + 1, 1 << 40]), max_size=40),
       st.integers(0, 6), st.integers(1, 5), st.integers(0, 4))
def test_the_lookup_is_not_fooled_by_bytes_that_match_across_tokens(tokens, k, lo, extra):
    """The lookup searches the tokens' bytes: ids whose bytes are shifted copies of each other's (256 is 1 a byte
    later) make matches that do not start on a token, which must not count."""
    assert lookup(tokens, k, lo, lo + extra) == reference_lookup(tokens, k, lo, lo + extra)


def test_settings_are_validated():
    with pytest.raises(ValueError):
        NgramSettings(3, 2)
    with pytest.raises(ValueError):
        NgramSettings(0, 2)


async def test_proposer_answers_each_input_in_order():
    proposer = NgramProposer(NgramSettings(1, 3))
    drafts = await proposer.propose([DraftInput("a", [1, 2, 1], 2), DraftInput("b", [9, 8], 2)])
    assert [list(d.token_ids) for d in drafts] == [[2, 1], []]


def tree(tokens, nodes, depth, lo=1, hi=4):
    from services.drafter.methods.ngram import propose_ngram_tree

    return propose_ngram_tree(np.array(tokens), nodes, depth, NgramSettings(lo, hi))


def paths(draft):
    from services.common.token_trees import leaf_paths

    return [[draft.token_ids[i] for i in path] for path in leaf_paths(list(draft.parents))]


def test_a_tree_merges_the_continuations_of_every_match_most_recent_first():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 7, 1, 2]
    # [1, 2] occurs at 0, 4 and 8: continuations (most recent first) [7, 1, 2], [3, 5, 1], [3, 4, 1]
    draft = tree(tokens, 16, 3)
    assert paths(draft) == [[7, 1, 2], [3, 5, 1], [3, 4, 1]]
    assert list(draft.token_ids[:3]) == lookup(tokens, 3)  # the first path is the chain
    assert all(p < i for i, p in enumerate(draft.parents))
    shares = dict(zip(draft.token_ids, draft.path_probs))  # the shared 3 carries two of the three matches
    assert draft.path_probs[draft.token_ids.index(3)] == pytest.approx(2 / 3) and shares[7] == pytest.approx(1 / 3)
    capped = tree(tokens, 4, 3)  # the node budget cuts the later branches
    assert len(capped.token_ids) == 4 and paths(capped) == [[7, 1, 2], [3]]
    assert paths(tree(tokens, 16, 1)) == [[7], [3]]  # depth 1: the distinct next tokens
    assert tree([5, 6, 7], 8, 3).token_ids == () and tree(tokens, 0, 3).token_ids == ()
    assert tree([1, 2], 8, 3, lo=3).token_ids == ()  # no n-gram that long


async def test_the_proposer_sends_trees_where_configured_and_declares_it():
    from services.common.speculative_config import SpeculativeConfig
    from services.drafter.methods.ngram import build_proposer

    chains = build_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    trees = build_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, num_draft_tokens=8))
    assert not chains.capabilities.sends_trees and trees.capabilities.sends_trees and trees.tree_depth == 3
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 7, 1, 2]
    [chain] = await chains.propose([DraftInput("a", tokens, 3)])
    [sent] = await trees.propose([DraftInput("a", tokens, 6)])  # K: the tree's tokens this step
    assert chain.parents is None and list(chain.token_ids) == [7, 1, 2]
    assert len(sent.token_ids) == 6 and paths(sent) == [[7, 1, 2], [3, 5, 1]]
