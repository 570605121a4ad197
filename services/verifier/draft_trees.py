"""Verifying a token tree as the set of its root-to-leaf chains, all scored by one forward.

The forward feeds a row's last committed token (the root) and every node of its tree at once (RowInput.parents),
so the logits at a node are the target's after that node's path. Each root-to-leaf path is then one chain of the
batch's ordinary verification (rejection.py), with the logits gathered along it: the deterministic rule emits,
on any path, the tokens speculation-off would sample (noise keyed by position, the drafts only decide how many
of them are confirmed at once), so the path that confirms the most is the tree's outcome and the output is the
same whichever tree was sent. Everything that verification does per chain (penalties along the drafts, token
rules, logprobs) applies unchanged; a request with output constraints feeds only its tree's first path
(ProposedDraft.first_path), since one grammar matcher cannot walk several paths at once. A sampled request's
q-tree (a drafter that sampled its tree sent q) is decided by tree_rejection.py's walk instead, which reads the
distributions verified here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.token_trees import leaf_paths
from services.verifier.draft_collection import ProposedDraft


@dataclass(frozen=True)
class VerifyLine:
    """One chain to verify: a request of the step, the fed positions of its forward that the chain runs through
    (0 is the last committed token, i + 1 the draft's token i) and the draft tokens along it."""

    state: int  # index among the step's requests
    fed: list[int]
    tokens: list[int]


def fed_parents(parents: Sequence[int]) -> list[int]:
    """The forward's parents for [last committed token, *tree]: the root first, every node one place later."""
    return [-1] + [p + 1 for p in parents]


def verify_lines(drafts: Sequence[ProposedDraft]) -> list[VerifyLine]:
    """One line per chain draft (or no draft), one per root-to-leaf path of a tree draft."""
    lines = []
    for index, draft in enumerate(drafts):
        if draft.parents is None:
            lines.append(VerifyLine(index, list(range(len(draft.tokens) + 1)), list(draft.tokens)))
            continue
        for path in leaf_paths(draft.parents):
            lines.append(VerifyLine(index, [0] + [i + 1 for i in path], [draft.tokens[i] for i in path]))
    return lines


def best_lines(lines: Sequence[VerifyLine], accepted: Sequence[int], num_states: int) -> list[int]:
    """For each request, the index of its line that confirmed the most drafts (the first on a tie)."""
    best: list[int | None] = [None] * num_states
    for index, line in enumerate(lines):
        current = best[line.state]
        if current is None or accepted[index] > accepted[current]:
            best[line.state] = index
    if any(b is None for b in best):
        raise ValueError("every request needs a verify line")
    return best  # type: ignore[return-value]


def fed_rows(lines: Sequence[VerifyLine], state: int, num_fed: int) -> tuple[list[int], list[int]]:
    """For each fed position 0..num_fed-1 of a request, a (line, offset) that runs through it: where the verified
    distributions hold that position's (every line through it holds the same, its path being the same)."""
    where: dict[int, tuple[int, int]] = {}
    for index, line in enumerate(lines):
        if line.state == state:
            for offset, fed in enumerate(line.fed):
                where.setdefault(fed, (index, offset))
    return [where[f][0] for f in range(num_fed)], [where[f][1] for f in range(num_fed)]


def line_through(lines: Sequence[VerifyLine], state: int, path: Sequence[int]) -> int:
    """The first of a request's lines that begins with the path of nodes `path` (root side first)."""
    fed = [0] + [node + 1 for node in path]
    return next(i for i, line in enumerate(lines) if line.state == state and line.fed[: len(fed)] == fed)


def line_length_through(parents: Sequence[int], path: Sequence[int]) -> int:
    """The drafts of the first of a tree's lines (verify_lines' order) that begins with the nodes `path`: what the
    eager verification reports as verified for a row whose accepted nodes are `path` (best_lines keeps the first
    line that accepts the most, and the lines that accept all of `path` are those through it)."""
    return next(len(line) for line in leaf_paths(parents) if line[: len(path)] == list(path))
