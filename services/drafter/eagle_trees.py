"""EAGLE-2's dynamic draft tree: at each depth the head expands the `topk` likeliest nodes (by path probability,
the product of the head's probabilities along the path) into their `topk` likeliest children, and after `depth`
levels the likeliest nodes of everything seen are sent as the tree (Li et al. 2024, arXiv 2406.16858).

A node is expanded as a chain step would be: its token's embedding with its parent's head output as the feature,
at head position root + depth + 1, attending to the sequence's committed head cache and the K/V its ancestors
left when they were expanded, so each expansion sees exactly what the chain along its path would. The candidates
of every sequence are drafted on the head's device as fixed-shape tensor work (eagle_tree_candidates.py, one
captured graph on an accelerator); here the host keeps each tree's best. A path's probability only falls as it
grows, so the best nodes are closed under ancestors (ties go to the shallower node); they are listed by depth,
likelier first, so parents come before their children and each node's first child is its likeliest: the
verifier's first path is the head's greedy chain, as far as it was kept.

A sampled request's q-tree (sampled_trees) is still drafted level by level here: which node it expands and how
many children it draws depend on draws read on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.token_trees import renumbered_parents
from services.modeling.eagle_head import DraftRows
from services.modeling.step_graphs import power_of_two_at_least

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values of one head position: [kv heads, 1, D] each


@dataclass(frozen=True)
class SentTree:
    """A tree as the drafter sends it (Draft): tokens, parents, and each node's path probability under the head."""

    tokens: list[int]
    parents: list[int]
    path_probs: list[float]


@dataclass(frozen=True)
class TreeStart:
    """One sequence's tree root: its committed head cache ([1, kv heads, L, D] each, or None), the head position of
    its last committed token, that token and its target feature [1, H]."""

    cache: KV | None
    position: int
    token: int
    feature: torch.Tensor


@dataclass
class _Expanded:
    """What expanding a token left: its K/V, its head output (the feature its children read), and the K/V of the
    expansions above it, root first (what its children attend to besides the committed cache and it)."""

    kv: KV
    out: torch.Tensor  # [1, 1, H]
    above: list[KV]

    def below(self) -> list[KV]:
        return [*self.above, self.kv]


@dataclass
class _Node:
    token: int
    parent: int  # index among the sequence's nodes; -1: a child of the last committed token
    depth: int  # 0 for the last committed token's children
    log_prob: float  # of the path to it
    expanded: _Expanded | None = None


@dataclass
class _Tree:
    start: TreeStart
    root: _Expanded | None = None
    nodes: list[_Node] = field(default_factory=list)

    def parent_of(self, node: _Node) -> _Expanded:
        return self.root if node.parent < 0 else self.nodes[node.parent].expanded


@dataclass(frozen=True)
class _Expansion:
    """One row of a level's batched head step: the token fed (a node, or the root's last committed token), the
    feature it reads, its head position and the K/V of the expansions above it."""

    tree: _Tree
    index: int  # the node's index in tree.nodes; -1 for the root
    token: int
    feature: torch.Tensor  # [1, 1, H]
    position: int
    above: list[KV]


def tree_shape(topk: int, depth: int, limits: Sequence[int], draft_rows: int,
               bucketed: bool = False) -> tuple[int, int]:
    """(topk, depth) of the trees drafted for rows of at most `limits` tokens: a tree of k tokens is at most k deep
    and holds at most k children of any node, so neither more levels nor more expansions a level are drafted than
    the largest limit needs (a 1-token probe costs one head step, not a whole tree's). `bucketed` (trees replayed
    as captured graphs): that limit counts as the next power of two, so that adaptive speculation's many limits
    make few shapes, each captured once before serving (eagle_head_graphs.capture_ahead); in a graph a level more
    costs next to nothing, and the rows still send their own `limits` best nodes (sent_trees)."""
    most = max(limits, default=0)
    if bucketed and most:
        most = power_of_two_at_least(most)
    return min(topk, most, draft_rows), min(depth, most)


def sent_trees(packed: torch.Tensor, limits: Sequence[int]) -> list[SentTree]:
    """Each row's `limits[b]` likeliest valid nodes of what tree_candidates packed (one copy to the host): ties go
    to the shallower node, then the first listed; sent by depth, likelier first, parents renumbered. In numpy over
    every row: a call of 8 rows of top-8, depth-4 candidates (200 nodes each) took 3.4 ms node by node in Python
    on a 2-core CPU, on a GPU host as long as the tree's graph."""
    array = packed.cpu().numpy()
    tokens, parents = array[:, 0].astype(np.int64), array[:, 1].astype(np.int64)
    log_probs, valid = array[:, 2], array[:, 3] != 0
    depths = _depths(parents)
    trees = []
    for b, limit in enumerate(limits):
        candidates = np.flatnonzero(valid[b])
        best = candidates[np.lexsort((depths[b, candidates], -log_probs[b, candidates]))[:limit]]
        order = best[np.lexsort((-log_probs[b, best], depths[b, best]))]
        trees.append(SentTree(tokens[b, order].tolist(), renumbered_parents(parents[b].tolist(), order.tolist()),
                              [math.exp(float(p)) for p in log_probs[b, order]]))
    return trees


def _depths(parents: np.ndarray) -> np.ndarray:
    """Each node's depth [B, N] from its parent's index ([B, N], -1 at the roots), a level a pass."""
    depths = np.zeros_like(parents)
    above, rows = parents.copy(), np.arange(parents.shape[0])[:, None]
    while (has := above >= 0).any():
        depths += has
        above = np.where(has, parents[rows, np.maximum(above, 0)], -1)
    return depths


@dataclass(frozen=True)
class SampledTree:
    """A q-tree as the drafter sends it for a sampled request (Draft.parents with Draft.probs): tokens, parents and
    each node's q, the head's distribution at its parent over the target's vocabulary [len(tokens), V]."""

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor


def sampled_trees(head, embed: torch.nn.Module, draft_rows: DraftRows, starts: Sequence[TreeStart], topk: int,
                  depth: int, limits: Sequence[int], vocab_size: int, temperatures: Sequence[float],
                  generator: torch.Generator) -> list[SampledTree]:
    """Each sampled sequence's q-tree: at each depth one node, the likeliest of the depth above (the root first),
    gets `topk` children drawn without replacement (Gumbel top-k) from the head's distribution at the request's
    temperature, listed in the order drawn; at most limits[b] tokens, breadth first, paths at most `depth` long.
    So every position of the head's likeliest path has topk - 1 drawn alternatives, and how many children a node
    gets never depends on which tokens they are, as multi-draft acceptance needs (tree_rejection.py). Draft ids
    past the target's vocabulary get no probability, so none is drawn."""
    most = max(limits, default=0)
    trees = [_Tree(start) for start in starts]
    q_rows: list[list[torch.Tensor]] = [[] for _ in starts]
    owner = {id(tree): b for b, tree in enumerate(trees)}
    pending = [_Expansion(t, -1, t.start.token, t.start.feature[None], t.start.position, []) for t in trees]
    weight = draft_rows.weight
    target_ids = head.token_ids(torch.arange(weight.shape[0], device=weight.device))  # per draft row
    in_vocab = target_ids < vocab_size
    for level in range(min(depth, most)):
        outputs, own = _expand(head, embed, pending)
        logits = head.draft_scores(outputs[:, -1], draft_rows).float()  # [R, Vd]
        temperature = torch.tensor([temperatures[owner[id(row.tree)]] for row in pending], device=logits.device)
        # q as the link carries it (float16), so the verifier reads exactly the distribution the tokens came from
        q_draft = torch.softmax((logits / temperature[:, None]).masked_fill(~in_vocab, float("-inf")), dim=-1)
        q_draft = q_draft.half().float()
        log_q = q_draft.log()
        uniform = torch.rand(log_q.shape, generator=generator, device="cpu").to(log_q.device).clamp_min(1e-20)
        draws = (log_q - torch.log(-torch.log(uniform))).topk(min(topk, log_q.shape[-1])).indices  # in draw order
        support = (q_draft > 0).sum(-1).tolist()  # a row draws no more tokens than q gives probability
        q = log_q.new_zeros(len(pending), vocab_size)
        q[:, target_ids[in_vocab]] = q_draft[:, in_vocab]  # [R, V]
        drawn_ids, drawn_log_q = target_ids[draws].tolist(), log_q.gather(-1, draws).tolist()
        for r, row in enumerate(pending):
            tree, b = row.tree, owner[id(row.tree)]
            expanded = _Expanded(own[r], outputs[r : r + 1], row.above)
            if row.index < 0:
                tree.root = expanded
            else:
                tree.nodes[row.index].expanded = expanded
            base = 0.0 if row.index < 0 else tree.nodes[row.index].log_prob
            kept = min(support[r], limits[b] - len(tree.nodes))
            for token, log_prob in list(zip(drawn_ids[r], drawn_log_q[r], strict=True))[:kept]:
                tree.nodes.append(_Node(token, row.index, level, base + log_prob))
                q_rows[b].append(q[r])
        pending = []
        if level + 1 < depth:
            for b, tree in enumerate(trees):
                level_nodes = [i for i, n in enumerate(tree.nodes) if n.depth == level]
                if level_nodes and len(tree.nodes) < limits[b]:
                    best = max(level_nodes, key=lambda i: tree.nodes[i].log_prob)
                    parent = tree.parent_of(tree.nodes[best])
                    pending.append(_Expansion(tree, best, tree.nodes[best].token, parent.out,
                                              tree.start.position + level + 1, parent.below()))
        if not pending:
            break
    return [SampledTree([n.token for n in tree.nodes], [n.parent for n in tree.nodes],
                        torch.stack(rows) if rows else torch.zeros(0, vocab_size))
            for tree, rows in zip(trees, q_rows, strict=True)]


def padded_caches(head, rows: Sequence[tuple[KV | None, Sequence[KV]]], room: int = 0) -> tuple[KV, torch.Tensor]:
    """Per row, a committed head cache ([1, kv heads, L, D] each, or None) followed by single positions' K/V, as one
    batch padded to the longest, W ([R, kv heads, W + room, D] each: `room` zero columns more, for a chain's or a
    tree's own K/V), and the mask of real columns [R, W]: what EagleHead.step_rows and a chain read. Only the columns
    past each row's own are zeroed (they are masked, and must be finite): zeroing the whole batch first cost as much
    as copying the caches."""
    heads, dim = head.config.num_key_value_heads, head.config.head_dim
    committed = [0 if cache is None else cache[0].shape[2] for cache, _ in rows]
    lengths = [c + len(extra) for c, (_, extra) in zip(committed, rows, strict=True)]
    width = max(lengths)
    keys = head.fc.weight.new_empty(len(rows), heads, width + room, dim)
    values = torch.empty_like(keys)
    for r, (cache, extra) in enumerate(rows):
        c = committed[r]
        if cache is not None:
            keys[r, :, :c], values[r, :, :c] = cache[0][0], cache[1][0]
        for j, (k, v) in enumerate(extra):
            keys[r, :, c + j : c + j + 1], values[r, :, c + j : c + j + 1] = k, v
        keys[r, :, lengths[r] :], values[r, :, lengths[r] :] = 0, 0
    device = keys.device
    mask = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return (keys, values), mask


def _expand(head, embed: torch.nn.Module, pending: Sequence[_Expansion]) -> tuple[torch.Tensor, list[KV]]:
    """One batched head step over every expansion, each row reading its sequence's committed cache and the K/V
    above it. Returns the outputs [R, 1, H] and each row's own K/V."""
    cache, mask = padded_caches(head, [(row.tree.start.cache, row.above) for row in pending])
    features = torch.cat([row.feature for row in pending])  # [R, 1, H]
    tokens = torch.tensor([row.token for row in pending], device=features.device)
    positions = torch.tensor([row.position for row in pending], device=features.device)
    out, (k, v), _ = head.step_rows(embed(tokens[:, None]), features, positions, cache, mask)
    return out, [(k[r, :, -1:], v[r, :, -1:]) for r in range(len(pending))]
