"""Which nodes of a token tree are worth verifying: the adaptive planner's view of a tree (speculation_planner.py).

A chain's position j adds a token with probability P(the first j drafts are accepted). A tree's node has no such
position: its depth d decides at most whether acceptance reaches d + 1, and its siblings compete for that depth.
So a node's expected gain is the row's survival to its depth (measured on the paths the verifier took, in depth
units) shared among the nodes at that depth by the drafter's path probabilities (Draft.path_probs; alike without
them), and never more than its parent's: a node is worth nothing once its parent is cut. The planner then treats a
tree row like a chain row whose positions are its nodes, best first: each node widens the forward by one column
(the forward feeds every node), and the width chosen for the batch keeps each tree's best nodes, which are closed
under ancestors (gains only fall along a path; ties go to the earlier node, parents come first).

Only which nodes are verified depends on this; acceptance never reads path probabilities (draft_trees.py), so any
cut is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.token_trees import renumbered_parents, tree_depths
from services.verifier.draft_collection import NO_DRAFT, ProposedDraft


def node_gains(draft: ProposedDraft, survival: Sequence[float]) -> list[float]:
    """Each node's expected accepted tokens: survival[d] (P(acceptance reaches depth d + 1)) for a node at depth d,
    shared among that depth's nodes by path probability, capped by its parent's gain (0 past `survival`)."""
    parents = draft.parents or []
    depths = tree_depths(parents)
    weights = draft.path_probs if draft.path_probs is not None else [1.0] * len(parents)
    totals: dict[int, float] = {}
    for depth, weight in zip(depths, weights, strict=True):
        totals[depth] = totals.get(depth, 0.0) + weight
    gains: list[float] = []
    for depth, weight, parent in zip(depths, weights, parents, strict=True):
        total = totals[depth]
        share = weight / total if total > 0 else 1.0 / depths.count(depth)
        gain = (survival[depth] if depth < len(survival) else 0.0) * share
        gains.append(min(gain, gains[parent]) if parent >= 0 else gain)
    return gains


def best_nodes(gains: Sequence[float], k: int) -> list[int]:
    """The k nodes of highest gain, in index order (closed under ancestors: see the module docstring)."""
    ranked = sorted(range(len(gains)), key=lambda i: (-gains[i], i))
    return sorted(ranked[: max(0, k)])


def keep_nodes(draft: ProposedDraft, kept: Sequence[int]) -> ProposedDraft:
    """The tree of the `kept` nodes (ancestor-closed, in index order), parents renumbered; a chain-shaped result
    stays a tree (the verifier feeds it either way)."""
    if not kept:
        return NO_DRAFT
    return ProposedDraft([draft.tokens[i] for i in kept], None if draft.probs is None else draft.probs[list(kept)],
                         renumbered_parents(draft.parents or [], kept),
                         None if draft.path_probs is None else [draft.path_probs[i] for i in kept])
