"""EAGLE-2 trees from the drafter: each node is one of the head's top-k after its path, scored by its path's
probability, as the head alone computes it step by step; top-1 trees are the chains; the first path is the chain."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.proposer import DraftInput
from services.common.token_trees import leaf_paths, tree_depths
from services.drafter.methods.eagle import EagleProposer
from tests.unit.test_eagle_proposer import V, random_head, reference_chain


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


@torch.no_grad()
def test_top_1_trees_are_the_chains():
    target, head, embed, lm_head = random_head(3)
    sequences, states = sequences_and_states(target, 0)
    proposer = EagleProposer(head, embed, lm_head, V, tree_nodes=4, tree_topk=1, tree_depth=4)
    drafts = proposer._draft_all([DraftInput(s, ids, 4, states[s]) for s, ids in sequences.items()])
    for (s, ids), draft in zip(sequences.items(), drafts, strict=True):
        assert list(draft.token_ids) == reference_chain(head, embed, lm_head.weight, ids, states[s], 4)
        assert list(draft.parents) == [-1, 0, 1, 2]


@pytest.mark.parametrize("seed", [1, 2])
@torch.no_grad()
def test_every_node_is_a_top_k_child_scored_by_its_path(seed):
    target, head, embed, lm_head = random_head(seed)
    sequences, states = sequences_and_states(target, seed)
    topk, depth, nodes = 3, 4, 10
    proposer = EagleProposer(head, embed, lm_head, V, tree_nodes=nodes, tree_topk=topk, tree_depth=depth)
    drafts = proposer._draft_all([DraftInput(s, ids, 12, states[s]) for s, ids in sequences.items()])
    for (s, ids), draft in zip(sequences.items(), drafts, strict=True):
        tokens, parents = list(draft.token_ids), list(draft.parents)
        assert len(tokens) == nodes and max(tree_depths(parents)) < depth
        for node in range(len(tokens)):
            path, up = [], node
            while up >= 0:
                path.append(up)
                up = parents[up]
            path_tokens = [tokens[i] for i in reversed(path)]
            log_probs = path_log_probs(head, embed, lm_head.weight, ids, states[s], path_tokens[:-1])
            last = log_probs[-1]
            assert path_tokens[-1] in last.topk(topk).indices.tolist()  # one of its parent's top-k
        # the first path is the head's greedy chain
        first = [tokens[i] for i in leaf_paths(parents)[0]]
        assert first == reference_chain(head, embed, lm_head.weight, ids, states[s], len(first))
        # scores: the path probabilities the head gives, falling along every path
        scores = []
        for node in range(len(tokens)):
            path, up = [], node
            while up >= 0:
                path.append(up)
                up = parents[up]
            path_tokens = [tokens[i] for i in reversed(path)]
            log_probs = path_log_probs(head, embed, lm_head.weight, ids, states[s], path_tokens[:-1])
            scores.append(sum(float(lp[t]) for lp, t in zip(log_probs, path_tokens, strict=True)))
        for node, parent in enumerate(parents):
            if parent >= 0:
                assert scores[node] <= scores[parent] + 1e-6
        assert not any(math.isnan(x) for x in scores)


@torch.no_grad()
def test_the_width_asked_bounds_the_tree():
    target, head, embed, lm_head = random_head(4)
    sequences, states = sequences_and_states(target, 4)
    proposer = EagleProposer(head, embed, lm_head, V, tree_nodes=10, tree_topk=3, tree_depth=4)
    drafts = proposer._draft_all([DraftInput(s, ids, 5, states[s]) for s, ids in sequences.items()])
    assert all(len(d.token_ids) == 5 and len(d.parents) == 5 for d in drafts)
