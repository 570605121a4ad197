"""Multi-draft rejection sampling over a token tree whose drafter sent q (SpecInfer's multi-step speculative
sampling, Miao et al. 2024, with siblings drawn without replacement as in Jeon et al. 2024).

A q-tree (Draft.probs with Draft.parents) says how it was drawn: node i's token was drawn from probs[i], its
parent's draft distribution, every sibling from the same one without replacement, in their index order. At a
reached node with target distribution p, the siblings are tried in order: sibling c_i, drawn from q_i (q without the
earlier siblings' tokens, renormalised), is accepted with probability min(1, r(c_i) / q_i(c_i)), where r starts as p
and after each rejection becomes norm(max(0, r - q_i)). An accepted sibling is descended into; when every sibling is
rejected, or the node has none, a token is drawn from r and the step ends. Each step's output is then distributed
as p, by the single-draft lemma applied sibling by sibling, for any number of siblings, as long as whether a sibling
was sent does not depend on its own token (drafters send a prefix of each node's draws; the planner keeps q-trees'
nodes by depth and order only, draft_collection.py).

Why bother when the deterministic rule (draft_trees.py) is exact for any tree: it accepts a node's children only
as often as the target samples one of them, while with q a child is accepted with probability min(1, p/q), so a
drafter whose q is close to the target's p is accepted nearly always at temperature 1. The price is trust: a
drafter that sends a q it did not sample from biases the output, as it would with a chain's q (rejection.py).

Uniform numbers are keyed by (seed, position) as everywhere (random_streams.py), so a seeded request repeats itself
given the same drafts; the tensor work of every q-tree row of a step runs on the device and comes to the host in one
transfer, then the walk is plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.sampling_rules import LOGPROB_FLOOR
from services.common.token_trees import tree_depths
from services.modeling.host_copies import to_device
from services.verifier import random_streams


@dataclass(frozen=True)
class TreeOutcome:
    """What a q-tree row emits: the accepted nodes, root side first, then one more token, with the processed
    target log-probabilities of all of them."""

    path: list[int]
    token: int
    logprobs: list[float]  # len(path) + 1


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Per fed position (0: the last committed token, i + 1: node i), its child nodes in index order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


@dataclass(frozen=True)
class QTreeRow:
    """One sampled request's q-tree as verified: the processed target log-probabilities at each fed position
    [n + 1, V] (0: the last committed token, i + 1: node i), its tokens and parents, q per node [n, V], its seed (an
    int64 1-element tensor) and the position the root's children take."""

    node_log_p: torch.Tensor
    tokens: Sequence[int]
    parents: Sequence[int]
    probs: torch.Tensor
    seed: torch.Tensor
    first_position: int


def decisions(rows: Sequence[QTreeRow]) -> torch.Tensor:
    """Every row's decisions on the device, all fed positions of all rows at once (one pass per sibling rank, not
    per node), packed as float64 [accepted per node, drawn token per fed position, log p of each node's token,
    log p of each drawn token], each part row after row."""
    device = rows[0].node_log_p.device
    log_p = torch.cat([row.node_log_p.float() for row in rows])  # [F, V], F fed positions in all
    vocab = log_p.shape[-1]
    if all(row.probs.device.type == "cpu" for row in rows):  # from the link: one copy to the device for all
        q = to_device(torch.cat([row.probs.float() for row in rows]), device)  # [N, V], N nodes in all
    else:
        q = torch.cat([row.probs.to(device=device, dtype=torch.float32) for row in rows])
    child_lists, fed_positions, fed_seeds, node_parent_fed = [], [], [], []
    fed_base = node_base = 0
    for index, row in enumerate(rows):
        depths = tree_depths(row.parents)
        child_lists += [[node_base + c for c in kids] for kids in children_of(row.parents)]
        fed_positions += [row.first_position] + [row.first_position + d + 1 for d in depths]
        fed_seeds += [index] * (len(row.tokens) + 1)
        node_parent_fed += [fed_base + parent + 1 for parent in row.parents]
        fed_base, node_base = fed_base + len(row.tokens) + 1, node_base + len(row.tokens)
    inner = [f for f, kids in enumerate(child_lists) if kids]  # fed positions with children: the rest draw from p
    widest = max((len(child_lists[f]) for f in inner), default=0)
    dummy = node_base
    child_at_rows = [child_lists[f][i] if i < len(child_lists[f]) else dummy for i in range(widest) for f in inner]
    # every index the device needs, in one host-to-device copy (pinned on CUDA, so the step does not wait for it)
    parts = [[t for row in rows for t in row.tokens] + [0], child_at_rows, fed_seeds, fed_positions, inner,
             node_parent_fed]  # tokens end with a dummy node's
    packed = to_device(torch.tensor([i for part in parts for i in part], dtype=torch.int64), device)
    tokens, child_flat, seed_rows, fed_position, inner_index, node_parent = packed.split([len(p) for p in parts])
    child_at = child_flat.view(widest, len(inner))  # [widest, inner]
    seeds = torch.cat([row.seed for row in rows])[seed_rows]  # [F]
    positions = fed_position[:, None]  # [F, 1]
    coins = random_streams.uniform(random_streams.position_keys(
        seeds[inner_index], positions[inner_index], random_streams.STREAM_ACCEPT), widest)[:, 0]  # [inner, widest]
    p = log_p.exp()
    r = p[inner_index]
    drawn = torch.zeros_like(r, dtype=torch.bool)
    accepted = torch.zeros(node_base + 1, dtype=torch.bool, device=device)
    for i in range(widest):
        child = child_at[i]
        has = child != dummy  # [inner]
        token = tokens[child][:, None]  # [inner, 1]
        q_i = q[child.clamp_max(dummy - 1)].masked_fill(drawn | ~has[:, None], 0.0)  # no child: q_i = 0, skipped
        q_i = q_i / q_i.sum(-1, keepdim=True).clamp_min(1e-30)
        q_token, r_token = q_i.gather(-1, token).squeeze(-1), r.gather(-1, token).squeeze(-1)
        drawable = has & (q_token > 0)  # a sibling that could not have been drawn (a duplicate, say) is skipped
        accepted[child] = drawable & (coins[:, i] * q_token < r_token)  # the dummy's entry is never read
        residual = (r - q_i).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        # after a rejection r becomes norm(max(0, r - q_i)); one of probability 0 (r <= q_i everywhere) leaves r
        r = torch.where((drawable[:, None] & (mass > 0)), residual / mass.clamp_min(1e-30), r)
        drawn |= torch.zeros_like(drawn).scatter_(1, token, has[:, None])
    # One token per fed position from what is left of its distribution, by inverse CDF with one keyed uniform (a
    # Gumbel race would hash every vocabulary entry of every position); a zero-probability token is never drawn.
    cdf = p.index_copy(0, inner_index, r).double().cumsum(dim=-1)  # [F, V]
    u = random_streams.uniform(random_streams.position_keys(seeds, positions, random_streams.STREAM_RESIDUAL), 1)
    draws = torch.searchsorted(cdf, u[:, 0] * cdf[:, -1:], right=True).squeeze(-1).clamp_max(vocab - 1)  # [F]
    node_lp = log_p[node_parent, tokens[:-1]]
    draw_lp = log_p.gather(-1, draws[:, None]).squeeze(-1)
    return torch.cat([accepted[:-1].double(), draws.double(), node_lp.double().clamp_min(LOGPROB_FLOOR),
                      draw_lp.double().clamp_min(LOGPROB_FLOOR)])


def outcomes(rows: Sequence[QTreeRow]) -> list[TreeOutcome]:
    """Each q-tree row's outcome; all rows' decisions come to the host in one transfer."""
    if not rows:
        return []
    packed = decisions(rows).tolist()
    num_nodes = sum(len(row.tokens) for row in rows)
    num_fed = num_nodes + len(rows)
    parts = [packed[:num_nodes], packed[num_nodes : num_nodes + num_fed],
             packed[num_nodes + num_fed : 2 * num_nodes + num_fed], packed[2 * num_nodes + num_fed :]]
    results, node, fed = [], 0, 0
    for row in rows:
        n = len(row.tokens)
        results.append(walk(parts[0][node : node + n], parts[1][fed : fed + n + 1], parts[2][node : node + n],
                            parts[3][fed : fed + n + 1], row.parents))
        node, fed = node + n, fed + n + 1
    return results


def walk(accepted: Sequence[float], draws: Sequence[float], node_lp: Sequence[float], draw_lp: Sequence[float],
         parents: Sequence[int]) -> TreeOutcome:
    """Descend from the root into the first accepted child at each node; stop at a node none of whose children
    was accepted and emit its drawn token. Per node: accepted, log p of its token; per fed position: the drawn
    token and its log p."""
    children = children_of(parents)
    path: list[int] = []
    fed = 0
    while True:
        chosen = next((child for child in children[fed] if accepted[child]), None)
        if chosen is None:
            return TreeOutcome(path, int(draws[fed]), [node_lp[i] for i in path] + [draw_lp[fed]])
        path.append(chosen)
        fed = chosen + 1
