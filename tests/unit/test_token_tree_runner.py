"""A token tree fed in one forward: every node's logits are those of the chain from the cached tokens to it, and
keep_path leaves the cache exactly as if that path had been fed as a chain (positions, K/V, published blocks)."""

from __future__ import annotations

import random

import pytest
import torch

from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.common.token_trees import cut_to_depth, tree_ancestors, tree_depths
from services.modeling.runner import RowInput
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2

BLOCK = 4  # small blocks, so that trees and paths cross block boundaries


def runner_for(model) -> LlamaFamilyRunner:
    return LlamaFamilyRunner(model, max_num_seqs=8, max_model_len=256, pack_weights=False,
                             kv_cache=KVCacheConfig(memory_bytes=4 << 20, block_size=BLOCK))


def random_tree(rng: random.Random, nodes: int) -> tuple[list[int], list[int]]:
    """(tokens, parents): a random tree, some siblings carrying the same token."""
    parents, tokens = [], []
    for i in range(nodes):
        parent = rng.randint(-1, i - 1)
        siblings = [tokens[j] for j in range(i) if parents[j] == parent]
        tokens.append(rng.choice(siblings) if siblings and rng.random() < 0.3 else rng.randrange(VOCAB))
        parents.append(parent)
    return tokens, parents


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def chain_logits(runner, seq_id, tokens: list[int]) -> torch.Tensor:
    """Logits of the last token of `tokens` fed as a chain to a new sequence."""
    runner.add_sequence(seq_id)
    logits = runner.forward([RowInput(seq_id, tokens, 1)]).logits[0, 0]
    runner.remove_sequence(seq_id)
    return logits


def test_tree_helpers():
    parents = [-1, 0, 0, 1, -1, 4]
    assert tree_depths(parents) == [0, 1, 1, 2, 0, 1]
    assert [j for j, seen in enumerate(tree_ancestors(parents)[3]) if seen] == [0, 1, 3]
    with pytest.raises(ValueError, match="parent"):
        tree_depths([0])
    assert cut_to_depth([10, 11, 12, 13, 14, 15], parents, 2) == ([10, 11, 12, 14, 15], [-1, 0, 0, -1, 3])
    assert cut_to_depth([10, 11, 12, 13, 14, 15], parents, 1) == ([10, 14], [-1, -1])


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_node_scores_as_its_path_would(make_model, seed):
    rng = random.Random(seed)
    runner = runner_for(make_model())
    prefix = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 13))]
    tokens, parents = random_tree(rng, 11)
    other = [rng.randrange(VOCAB) for _ in range(9)]
    runner.add_sequence("tree")
    runner.forward([RowInput("tree", prefix, 1)])
    runner.add_sequence("chain")  # a chain row in the same forward is untouched by the tree beside it
    runner.forward([RowInput("chain", other[:6], 1)])

    out = runner.forward([RowInput("tree", tokens, len(tokens), parents), RowInput("chain", other[6:], 3)])

    for node in range(len(tokens)):
        expected = chain_logits(runner, f"ref{node}", prefix + [tokens[j] for j in path_to(parents, node)])
        torch.testing.assert_close(out.logits[0, node], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1, 2], chain_logits(runner, "refc", other), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_keep_path_leaves_the_cache_as_the_chain_would(seed):
    rng = random.Random(seed)
    runner = runner_for(tiny_llama())
    prefix = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 13))]
    tokens, parents = random_tree(rng, 12)
    runner.add_sequence("tree")
    runner.forward([RowInput("tree", prefix, 1)])
    runner.forward([RowInput("tree", tokens, len(tokens), parents)])
    deepest = max(range(len(tokens)), key=lambda i: (tree_depths(parents)[i], i))
    path = path_to(parents, deepest)[: rng.randint(1, tree_depths(parents)[deepest] + 1)]
    runner.keep_path("tree", len(prefix), path)
    kept = prefix + [tokens[j] for j in path]
    assert runner.length("tree") == len(kept)

    follow = [rng.randrange(VOCAB) for _ in range(3)]
    got = runner.forward([RowInput("tree", follow, 3)]).logits[0]
    runner.add_sequence("chain")
    want = runner.forward([RowInput("chain", kept + follow, 3)]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # the blocks published after keep_path hold the path: a new prompt that starts with it reuses them
    cached = runner.add_sequence("again", kept + follow + [1])
    assert cached == (len(kept) + len(follow)) // BLOCK * BLOCK
    assert runner.forward([RowInput("again", (kept + follow + [1])[cached:], 1)]).logits.isfinite().all()


def test_a_tree_whose_root_is_rejected_goes_with_truncate():
    runner = runner_for(tiny_llama())
    runner.add_sequence("a")
    runner.forward([RowInput("a", list(range(10, 19)), 1)])
    runner.forward([RowInput("a", [5, 6, 7, 8], 4, [-1, -1, 0, 2])])
    runner.truncate("a", 9)
    got = runner.forward([RowInput("a", [3], 1)]).logits[0, 0]
    torch.testing.assert_close(got, chain_logits(runner, "b", list(range(10, 19)) + [3]), atol=1e-4, rtol=1e-4)
