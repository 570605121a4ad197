"""Token trees as the link carries them (Draft.parents): parents[i] is the index of token i's parent, -1 for a
token that follows the committed ones, and every parent comes before its children. Pure functions shared by the
drafters that build trees, the verifier that checks them and the runner that feeds them (no torch here: the
ngram and suffix drafters run without it)."""

from __future__ import annotations

from collections.abc import Sequence


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (0 for a node whose parent is -1); ValueError unless every parent is -1 or an earlier
    node."""
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: a parent must be -1 or an earlier node")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_ancestors(parents: Sequence[int]) -> list[list[bool]]:
    """[i][j]: node j is node i or one of its ancestors."""
    tree_depths(parents)  # validates
    rows: list[list[bool]] = []
    for i, parent in enumerate(parents):
        row = list(rows[parent]) if parent >= 0 else [False] * len(parents)
        row[i] = True
        rows.append(row)
    return rows


def leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """The root-to-leaf paths as lists of node indices, depth first with children in index order: the first path
    follows each node's first child (a drafter's likeliest chain, where it lists children by rank)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # index 0: the roots' (parent -1)
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    paths: list[list[int]] = []
    stack = [[node] for node in reversed(children[0])]
    while stack:
        path = stack.pop()
        below = children[path[-1] + 1]
        if not below:
            paths.append(path)
        stack.extend(path + [child] for child in reversed(below))
    return paths


def renumbered_parents(parents: Sequence[int], kept: Sequence[int]) -> list[int]:
    """The parents of the subtree of nodes `kept` (closed under ancestors, listed parents first), as indices into
    `kept`."""
    where = {old: new for new, old in enumerate(kept)}
    return [where[parents[i]] if parents[i] >= 0 else -1 for i in kept]


def nodes_to_depth(parents: Sequence[int], max_depth: int) -> list[int]:
    """The nodes above depth max_depth (a path through them holds at most max_depth tokens), in their order."""
    return [i for i, depth in enumerate(tree_depths(parents)) if depth < max_depth]


def cut_to_depth(tokens: Sequence[int], parents: Sequence[int], max_depth: int) -> tuple[list[int], list[int]]:
    """The tree without its nodes at depth max_depth or more, the kept nodes in their order and their parents
    renumbered."""
    kept = nodes_to_depth(parents, max_depth)
    return [tokens[i] for i in kept], renumbered_parents(parents, kept)
