"""Which nodes of a token tree the adaptive planner verifies (services/verifier/tree_budget.py): gains by depth
survival shared by path probability, cuts closed under ancestors, and the planner keeping a likelier branch that
the drafter listed last."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.common.token_trees import tree_depths
from services.verifier.draft_collection import ProposedDraft
from services.verifier.request_state import RequestState
from services.verifier.sampling_params import GenerationRequest, SpeculationParams
from services.verifier.speculation_planner import SpeculationPlanner
from services.verifier.tree_budget import best_nodes, keep_nodes, node_gains
from tests.step_costs import FixedCost

TREE = ProposedDraft([10, 11, 12, 13], None, [-1, -1, 0, 1], [0.6, 0.3, 0.5, 0.1])  # paths 10-12, 11-13


def test_a_depths_survival_is_shared_among_its_nodes_by_path_probability():
    assert node_gains(TREE, [0.8, 0.5]) == pytest.approx([0.8 * 0.6 / 0.9, 0.8 * 0.3 / 0.9, 0.5 * 0.5 / 0.6,
                                                          0.5 * 0.1 / 0.6])
    unranked = ProposedDraft(TREE.tokens, None, TREE.parents)
    assert node_gains(unranked, [0.8, 0.5]) == pytest.approx([0.4, 0.4, 0.25, 0.25])
    assert node_gains(TREE, [0.8]) == pytest.approx([0.8 * 0.6 / 0.9, 0.8 * 0.3 / 0.9, 0.0, 0.0])  # past survival


def test_a_node_is_worth_no_more_than_its_parent():
    weak_parent = ProposedDraft([1, 2, 3], None, [-1, -1, 1], [0.9, 0.1, 0.1])  # 3 is alone at its depth
    assert node_gains(weak_parent, [1.0, 0.9]) == pytest.approx([0.9, 0.1, 0.1])


def test_the_best_nodes_are_a_tree_for_every_budget():
    rng = random.Random(4)
    for _ in range(300):
        n = rng.randint(1, 14)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        probs = [rng.random() for _ in range(n)] if rng.random() < 0.7 else None
        draft = ProposedDraft(list(range(100, 100 + n)), None, parents, probs)
        depth = 1 + max(tree_depths(parents), default=-1)  # the longest path's tokens
        survival = sorted((rng.random() for _ in range(depth)), reverse=True)
        gains = node_gains(draft, survival)
        for k in range(n + 1):
            kept = best_nodes(gains, k)
            assert len(kept) == k and all(parents[i] < 0 or parents[i] in kept for i in kept)
            cut = keep_nodes(draft, kept)
            assert cut.tokens == [100 + i for i in kept]
            tree_depths(cut.parents or [])  # parents before children
            assert [cut.tokens[p] if p >= 0 else None for p in (cut.parents or [])] == [
                100 + parents[i] if parents[i] >= 0 else None for i in kept]


def test_keep_nodes_renumbers_parents_and_keeps_path_probabilities():
    assert keep_nodes(TREE, [1, 3]) == ProposedDraft([11, 13], None, [-1, 0], [0.3, 0.1])
    assert keep_nodes(TREE, []).tokens == []


def test_the_planner_keeps_the_likelier_branch_that_the_drafter_listed_last():
    """16 rows under a CPU's cost shape afford a few nodes each: the two nodes of the 0.9 branch, not the first
    two nodes sent (a chain cut would keep those)."""

    async def states() -> list[RequestState]:
        return [RequestState(GenerationRequest(f"r{i}", (1, 2, 3), speculation=SpeculationParams("tree", 8)), 0,
                             [1, 2, 3], asyncio.Queue()) for i in range(16)]

    planner = SpeculationPlanner(FixedCost(), adaptive=True)
    decode = asyncio.run(states())
    for state in decode:
        state.speculation = planner.start("tree")
        for _ in range(20):
            state.speculation.acceptance.observe(2, 2)  # both depths accepted: survival near 1
    parents = [-1, 0, 1, -1, 3, -1, 5, 6]  # three branches: 0-1-2, 3-4, 5-6-7
    probs = [0.05, 0.02, 0.01, 0.04, 0.01, 0.9, 0.85, 0.02]
    drafts = [ProposedDraft(list(range(20, 28)), None, parents, probs) for _ in decode]
    chosen = planner.choose_drafts(decode, drafts)
    assert all(0 < len(d.tokens) < 8 for d in chosen)
    assert all(d.tokens[:2] == [25, 26] and d.parents[:2] == [-1, 0] for d in chosen), chosen[0]
    for state in decode:  # depth 1 always accepted, depth 2 rarely: 16 rows afford one token each, not a tree
        for _ in range(20):
            state.speculation.acceptance.observe(4, 1)
    assert planner.draft_requests(decode, [8] * 16) == [1] * 16  # a 1-token tree costs its drafter one head step

