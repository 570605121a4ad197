"""Multi-draft rejection sampling over q-trees (tree_rejection.py), row by row: the emitted pair of tokens follows
the target's joint distribution for trees drawn as the contract says (siblings without replacement, in draw order),
a drafter that sends another q than it drew from is caught (the test's power), and with q close to p the walk
accepts more than the deterministic rule does on the same trees."""

from __future__ import annotations

import numpy as np
import torch

from services.verifier import random_streams
from services.verifier.tree_rejection import QTreeRow, TreeOutcome, children_of, outcomes, walk
from tests.stats import ALPHA, chi_square_p_value, total_variation

V = 6
N = 5000
POSITION = 40
PARENTS = [-1, -1, -1, 0, 0, 1, 1, 2, 2]  # three first-level draws, two below each, breadth first


def target(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """p1 [V] at the root and p2 [V, V] after each first token."""
    rng = np.random.default_rng(seed)
    p1 = np.exp(rng.normal(0, 1.2, V))
    p2 = np.exp(rng.normal(0, 1.2, (V, V)))
    return p1 / p1.sum(), p2 / p2.sum(-1, keepdims=True)


def draw_tree(q1: np.ndarray, q2: np.ndarray, generator: torch.Generator) -> list[int]:
    """Tokens of PARENTS' shape, each node's children drawn without replacement from its q (Gumbel top-k)."""
    def draws(q: np.ndarray, k: int) -> list[int]:
        noise = -torch.log(-torch.log(torch.rand(V, generator=generator, dtype=torch.float64)))
        return (torch.from_numpy(np.log(q)) + noise).topk(k).indices.tolist()

    first = draws(q1, 3)
    return first + [t for a in first for t in draws(q2[a], 2)]


def run(p1, p2, q1, q2, sent_q1, sent_q2, seed: int = 0) -> tuple[np.ndarray, float]:
    """The joint histogram of the first two emitted tokens over N rows (a row that emitted one token samples the
    second from p2 as the next step would), and the mean number of accepted nodes."""
    generator = torch.Generator().manual_seed(seed)
    rows, trees = [], []
    for row in range(N):
        tokens = draw_tree(q1, q2, generator)
        fed = [p1] + [p2[t] for t in tokens[:3]] + [None] * 6  # leaves' own distributions are never needed past them
        node_p = np.stack([f if f is not None else np.full(V, 1.0 / V) for f in fed])
        probs = np.stack([sent_q1] * 3 + [sent_q2[tokens[parent]] for parent in PARENTS[3:]])
        rows.append(QTreeRow(torch.from_numpy(np.log(node_p)).float(), tokens, PARENTS,
                             torch.from_numpy(probs).float(), torch.tensor([random_streams.seed_to_int64(row)]),
                             POSITION))
        trees.append(tokens)
    joint = np.zeros((V, V))
    accepted = 0
    for row, outcome in zip(rows, outcomes(rows), strict=True):
        seed_t = row.seed
        emitted = [row.tokens[i] for i in outcome.path] + [outcome.token]
        accepted += len(outcome.path)
        if len(emitted) == 1:  # the next step's plain sample at the next position
            noise = random_streams.gumbel(random_streams.position_keys(
                seed_t, torch.tensor([[POSITION + 1]]), random_streams.STREAM_SAMPLE), V)[0, 0]
            emitted.append(int((torch.from_numpy(np.log(p2[emitted[0]])).float() + noise).argmax()))
        joint[emitted[0], emitted[1]] += 1
    return joint, accepted / N


def test_children_and_walk():
    assert children_of([-1, -1, 0, 2]) == [[0, 1], [2], [], [3], []]
    # node 1 accepted, node 0 not; nothing below node 1: emit the draw at fed 2
    outcome = walk([0, 1, 0, 0], [7, 8, 9, 10, 11], [-1.0, -2.0, -3.0, -4.0], [-0.1, -0.2, -0.3, -0.4, -0.5],
                   [-1, -1, 0, 2])
    assert outcome == TreeOutcome([1], 9, [-2.0, -0.3])


def test_q_trees_follow_the_target():
    p1, p2 = target(1)
    rng = np.random.default_rng(2)
    q1 = np.exp(rng.normal(0, 1.0, V)); q1 /= q1.sum()
    q2 = np.exp(rng.normal(0, 1.0, (V, V))); q2 /= q2.sum(-1, keepdims=True)
    joint, accepted = run(p1, p2, q1, q2, q1, q2)
    expected = p1[:, None] * p2
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
    assert accepted > 0.5
    # negative control: drawn from the uniform, sent as q: the walk then trusts a wrong q and is biased
    uniform1, uniform2 = np.full(V, 1.0 / V), np.full((V, V), 1.0 / V)
    biased, _ = run(p1, p2, uniform1, uniform2, q1, q2)
    assert chi_square_p_value(biased, expected) < ALPHA


def test_q_close_to_the_target_is_accepted_more_than_the_deterministic_rule_would():
    """With q = p the first draw is always accepted; the deterministic rule accepts a node's children only when the
    target's sample is one of them (the same trees, the same seeds)."""
    p1, p2 = target(3)
    _, with_q = run(p1, p2, p1, p2, p1, p2)
    assert with_q == 2.0  # both levels accepted on every row
    generator = torch.Generator().manual_seed(0)
    trees = [draw_tree(p1, p2, generator) for _ in range(N)]
    seeds = torch.tensor([random_streams.seed_to_int64(row) for row in range(N)])

    def samples(log_p: torch.Tensor, position: int) -> list[int]:  # log_p [N, V]: speculation-off's tokens
        noise = random_streams.gumbel(random_streams.position_keys(
            seeds, torch.full((N, 1), position), random_streams.STREAM_SAMPLE), V)[:, 0]
        return (log_p + noise).argmax(-1).tolist()

    firsts = samples(torch.from_numpy(np.log(p1)).float().expand(N, V), POSITION)
    seconds = samples(torch.from_numpy(np.log(p2[firsts])).float(), POSITION + 1)
    deterministic = 0
    for tokens, first, second in zip(trees, firsts, seconds, strict=True):
        if first in tokens[:3]:
            below = 3 + 2 * tokens[:3].index(first)
            deterministic += 1 + (second in tokens[below : below + 2])
    assert deterministic / N < 0.9 * with_q
