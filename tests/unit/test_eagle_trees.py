"""EAGLE-2 trees from the drafter: each node is one of the head's top-k after its path, scored by its path's
probability, as the head alone computes it step by step; top-1 trees are the chains; the first path is the chain."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch

from services.common.proposer import DraftInput
from services.common.token_trees import leaf_paths, tree_depths
from services.drafter.methods.eagle import EagleProposer
from tests.stats import ALPHA, chi_square_p_value, total_variation
from tests.unit.test_eagle_proposer import V, random_head, reference_chain
from tests.unit.test_token_tree_runner import path_to


def path_log_probs(head, embed, weight, tokens: list[int], states: torch.Tensor, path: list[int]) -> list[torch.Tensor]:
    """The head alone, one sequence: its log-probabilities over the draft vocabulary (as target ids' rows) after
    the committed tokens and then after each token of `path` fed in turn."""
    n = len(tokens) - 1
    cache = None
    if n > 1:
        _, cache = head.step(embed(torch.tensor([tokens[1:n]])), states[None, : n - 1], 0, None)
    token, feature, out_log_probs = tokens[n], states[None, n - 1 : n], []
    for j in range(len(path) + 1):
        out, cache = head.step(embed(torch.tensor([[token]])), feature, n - 1 + j, cache)
        out_log_probs.append(torch.log_softmax(out[0, -1] @ weight.T, dim=-1))
        if j < len(path):
            token, feature = path[j], out
    return out_log_probs


def sequences_and_states(target, seed: int):
    generator = torch.Generator().manual_seed(seed)
    sequences = {"a": torch.randint(0, V, (9,), generator=generator).tolist(),
                 "b": torch.randint(0, V, (3,), generator=generator).tolist(),
                 "c": torch.randint(0, V, (14,), generator=generator).tolist()}
    with torch.no_grad():
        states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                  for s, ids in sequences.items()}
    return sequences, states


def tree_drafts(head_seed: int, seed: int, width: int, nodes: int, topk: int, depth: int):
    """A random head drafting trees for three sequences asked for `width` tokens each: (head, embed, lm_head,
    sequences, states, drafts)."""
    target, head, embed, lm_head = random_head(head_seed)
    sequences, states = sequences_and_states(target, seed)
    proposer = EagleProposer(head, embed, lm_head, V, tree_nodes=nodes, tree_topk=topk, tree_depth=depth)
    drafts = proposer._draft_all([DraftInput(s, ids, width, states[s]) for s, ids in sequences.items()])
    return head, embed, lm_head, sequences, states, drafts


@torch.no_grad()
def test_top_1_trees_are_the_chains():
    head, embed, lm_head, sequences, states, drafts = tree_drafts(3, 0, width=4, nodes=4, topk=1, depth=4)
    for (s, ids), draft in zip(sequences.items(), drafts, strict=True):
        assert list(draft.token_ids) == reference_chain(head, embed, lm_head.weight, ids, states[s], 4)
        assert list(draft.parents) == [-1, 0, 1, 2]


@pytest.mark.parametrize("seed", [1, 2])
@torch.no_grad()
def test_every_node_is_a_top_k_child_scored_by_its_path(seed):
    topk, depth, nodes = 3, 4, 10
    head, embed, lm_head, sequences, states, drafts = tree_drafts(seed, seed, 12, nodes, topk, depth)
    for (s, ids), draft in zip(sequences.items(), drafts, strict=True):
        tokens, parents = list(draft.token_ids), list(draft.parents)
        assert len(tokens) == nodes and max(tree_depths(parents)) < depth
        scores = []  # the path probabilities the head gives, which must fall along every path
        for node in range(len(tokens)):
            path_tokens = [tokens[i] for i in path_to(parents, node)]
            log_probs = path_log_probs(head, embed, lm_head.weight, ids, states[s], path_tokens[:-1])
            assert path_tokens[-1] in log_probs[-1].topk(topk).indices.tolist()  # one of its parent's top-k
            scores.append(sum(float(lp[t]) for lp, t in zip(log_probs, path_tokens, strict=True)))
        # the first path is the head's greedy chain
        first = [tokens[i] for i in leaf_paths(parents)[0]]
        assert first == reference_chain(head, embed, lm_head.weight, ids, states[s], len(first))
        for node, parent in enumerate(parents):
            if parent >= 0:
                assert scores[node] <= scores[parent] + 1e-6
        assert not any(math.isnan(x) for x in scores)


def reference_tree(head, embed, weight, tokens: list[int], states: torch.Tensor, topk: int, depth: int,
                   limit: int, vocab_size: int) -> tuple[list[int], list[int]]:
    """EAGLE-2 written out plainly for one sequence, with the head alone: expand the root, then at each level the
    topk likeliest nodes of the level above, into their topk likeliest children (a token past the target's
    vocabulary is dropped, with everything below it); send the `limit` likeliest nodes (ties: the shallower), by
    depth then likelier first."""
    nodes = []  # (token, parent, depth, path log-probability)
    frontier = [-1]
    for level in range(depth):
        for parent in frontier:
            path, node = [], parent
            while node >= 0:
                path.insert(0, nodes[node][0])
                node = nodes[node][1]
            log_probs = path_log_probs(head, embed, weight, tokens, states, path)[-1]
            base = 0.0 if parent < 0 else nodes[parent][3]
            top = log_probs.topk(topk)
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                if token < vocab_size:
                    nodes.append((token, parent, level, base + value))
        frontier = sorted((i for i, n in enumerate(nodes) if n[2] == level), key=lambda i: -nodes[i][3])[:topk]
    best = sorted(range(len(nodes)), key=lambda i: (-nodes[i][3], nodes[i][2]))[:limit]
    order = sorted(best, key=lambda i: (nodes[i][2], -nodes[i][3]))
    return [nodes[i][0] for i in order], [order.index(nodes[i][1]) if nodes[i][1] >= 0 else -1 for i in order]


@pytest.mark.parametrize(("seed", "topk", "depth", "nodes", "vocab_size"), [
    (1, 3, 4, 10, V), (2, 4, 3, 16, V), (3, 2, 5, 9, V), (4, 4, 4, 20, V - 50), (5, 5, 2, 25, 20)])
@torch.no_grad()
def test_trees_are_the_plain_eagle_2_trees_node_for_node(seed, topk, depth, nodes, vocab_size):
    """The batched, fixed-shape candidates (eagle_tree_candidates.py) give, for every sequence of a call, exactly
    the tree the plain one-sequence expansion gives, including where draft ids past the target's vocabulary are
    dropped (vocab_size below the head's)."""
    target, head, embed, lm_head = random_head(seed)
    sequences, states = sequences_and_states(target, seed)
    proposer = EagleProposer(head, embed, lm_head, vocab_size, tree_nodes=nodes, tree_topk=topk, tree_depth=depth)
    drafts = proposer._draft_all([DraftInput(s, ids, nodes, states[s]) for s, ids in sequences.items()])
    for (s, ids), draft in zip(sequences.items(), drafts, strict=True):
        expected = reference_tree(head, embed, lm_head.weight, ids, states[s], topk, depth, nodes, vocab_size)
        assert (list(draft.token_ids), list(draft.parents)) == expected, s
        assert all(t < vocab_size for t in draft.token_ids)


@torch.no_grad()
def test_the_width_asked_bounds_the_tree():
    *_, drafts = tree_drafts(4, 4, width=5, nodes=10, topk=3, depth=4)
    assert all(len(d.token_ids) == 5 and len(d.parents) == 5 for d in drafts)


@torch.no_grad()
def test_a_small_budget_drafts_the_same_tree_with_fewer_head_steps():
    """A tree of k tokens needs at most k levels and k expansions a level: asked for 3 tokens, the drafter expands
    less and sends exactly the 3 nodes that a full 4-level, top-4 expansion keeps; path probabilities come along.
    (One batched head step a level, each sequence's nodes of that level its queries.)"""
    from services.modeling.eagle_head import EagleHead

    for k in (1, 2, 3):
        with mock.patch.object(EagleHead, "step_tree", autospec=True, side_effect=EagleHead.step_tree) as step:
            *_, small = tree_drafts(5, 1, width=k, nodes=12, topk=4, depth=4)
        assert step.call_count == k and max(call.args[1].shape[1] for call in step.call_args_list) <= k
        *_, full = tree_drafts(5, 1, width=12, nodes=12, topk=4, depth=4)
        for cut, whole in zip(small, full, strict=True):
            ranked = sorted(range(len(whole.token_ids)), key=lambda i: (-whole.path_probs[i], tree_depths(
                whole.parents)[i]))[:k]
            assert sorted((whole.token_ids[i], round(whole.path_probs[i], 5)) for i in ranked) == sorted(
                (t, round(p, 5)) for t, p in zip(cut.token_ids, cut.path_probs, strict=True)), k
            assert all(0 < p <= 1 for p in whole.path_probs)


@torch.no_grad()
def test_a_sampled_request_gets_a_q_tree_drawn_from_the_head_at_its_temperature():
    """eagle_sampled_trees: a sampled sequence's tree holds, at each depth, topk distinct draws below the likeliest
    node of the depth above; each node's q is the head's distribution after its parent's path at the request's
    temperature, in float16; the first draws follow that q (chi-square over many trees); a greedy sequence still gets the
    deterministic tree."""
    from services.common.token_trees import tree_depths as depths_of

    target, head, embed, lm_head = random_head(6)
    sequences, states = sequences_and_states(target, 6)
    proposer = EagleProposer(head, embed, lm_head, V, tree_nodes=6, tree_topk=2, tree_depth=4, sampled_trees=True)
    temperature = 0.8
    inputs = [DraftInput("a", sequences["a"], 6, states["a"], temperature=temperature),
              DraftInput("c", sequences["c"], 6, states["c"])]
    sampled, greedy = proposer._draft_all(inputs)
    assert greedy.probs is None and greedy.path_probs is not None
    tokens, parents = list(sampled.token_ids), list(sampled.parents)
    assert len(tokens) == 6 and depths_of(parents) == [0, 0, 1, 1, 2, 2]
    for depth in range(3):
        siblings = [i for i, d in enumerate(depths_of(parents)) if d == depth]
        assert len({tokens[i] for i in siblings}) == 2 and len({parents[i] for i in siblings}) == 1
        below = parents[siblings[0] + 2] if depth < 2 else None
        if below is not None:  # the likeliest of the depth's nodes is the one expanded
            assert below == max(siblings, key=lambda i: float(sampled.probs[i, tokens[i]]))
    for node in range(len(tokens)):
        path = [tokens[i] for i in path_to(parents, node)][:-1]
        log_probs = path_log_probs(head, embed, lm_head.weight, sequences["a"], states["a"], path)[-1]
        # float16, as the link carries it and as the tokens were drawn from it
        assert torch.allclose(sampled.probs[node], torch.softmax(log_probs / temperature, -1), rtol=1e-3, atol=1e-7)
        assert torch.equal(sampled.probs[node], sampled.probs[node].half().float())
    from services.drafter.eagle_trees import sampled_trees

    proposer.release("a")
    [start] = proposer._catch_up([DraftInput("a", sequences["a"], 6, states["a"])])
    draws = 1500  # the root's first draw, 1500 times in one batch
    trees = sampled_trees(head, embed, proposer._draft_rows(), [start.tree_start()] * draws, 2, 4, [1] * draws, V,
                          [temperature] * draws, torch.Generator().manual_seed(1))
    counts = np.bincount([tree.tokens[0] for tree in trees], minlength=V)
    q = sampled.probs[0].numpy()
    assert chi_square_p_value(counts, q) > ALPHA, total_variation(counts, q)
