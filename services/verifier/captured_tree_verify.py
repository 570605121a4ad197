"""A token tree's verification inside the step's captured graph: VerifyTail (captured_verify.py) for trees.

A tree step's forward replays a captured graph like a chain's (a graph's batch carries an ancestor table, so one
graph serves chains and trees: forward_batch.py), but its verification ran after it kernel by kernel, as the
chains' did before VerifyTail, and with more: each root-to-leaf path gathered into a chain, verified as one
(draft_trees.py), the best path picked on the host. On an accelerator every tree step paid those launches.

Here the same deterministic rule runs on the tree itself, in tensor work of fixed shapes. The token that
speculation-off samples after fed position f (the last committed token, or node f - 1) is y_f, keyed by the
position it would take (rejection.coupled_samples: the same function, so the same tokens). Node i is accepted when
its token is y at its parent's fed position and its parent is accepted (or is the root). With distinct siblings at
most one child of a node can be accepted, so the accepted nodes are one path from the root: the path the eager
verification picks, the one whose line confirms the most (a tree whose siblings repeat a token is left to the
eager path, which breaks such ties by line order). The row emits that path's tokens and y after its last node,
and keeps that path's K/V (ModelRunner.keep_path), as the eager path does.

It takes what VerifyTail takes (temperature and seed alone, no q for a sampled row) plus trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common.token_trees import tree_depths
from services.verifier.draft_collection import ProposedDraft
from services.verifier.logits_processing import processed_log_probs
from services.verifier.rejection import coupled_samples
from services.verifier.request_state import RequestState
from services.verifier.tail_rows import COLUMNS, TailRows, sampling_fields, unpack


def distinct_siblings(draft: ProposedDraft) -> bool:
    """No two children of one parent carry the same token (the accepted nodes are then one path)."""
    pairs = list(zip(draft.parents, draft.tokens, strict=True))
    return len(set(pairs)) == len(pairs)


@dataclass(frozen=True)
class TreeVerifyTail(TailRows):
    """One step's verification of chain and tree rows as a GraphTail: per row its draft tokens and their parents
    (a chain's: each the one before), and what TailRows carries."""

    tokens: tuple[tuple[int, ...], ...] = ()
    parents: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, states: Sequence[RequestState], drafts: Sequence[ProposedDraft]) -> TreeVerifyTail:
        parents = tuple(tuple(range(-1, len(d.tokens) - 1)) if d.parents is None else tuple(d.parents)
                        for d in drafts)
        return cls(tokens=tuple(tuple(d.tokens) for d in drafts), parents=parents, **sampling_fields(states))

    feeds_trees = True  # the runner feeds its rows' trees (llama_runner.forward_with_tail)

    @property
    def key(self) -> tuple[str, bool]:
        return ("verify-tree", self.sampled)

    def inputs(self, rows: int, width: int) -> torch.Tensor:
        """[rows, 3 * width + 2] int64 (nodes' tokens and parents padded to width - 1, each fed position's depth
        below the root, tail_rows.COLUMNS), then the rows' temperatures as float64 bits (tail_rows.pack); padding
        rows have no nodes, and a padded node has parent -1 and is never counted."""
        k = width - 1
        ints = np.zeros((rows, 3 * k + 1 + COLUMNS), dtype=np.int64)
        ints[:, k : 2 * k] = -1
        for b, (tokens, parents) in enumerate(zip(self.tokens, self.parents, strict=True)):
            n = len(tokens)
            ints[b, :n], ints[b, k : k + n] = tokens, parents
            ints[b, 2 * k + 1 : 2 * k + 1 + n] = np.asarray(tree_depths(parents), dtype=np.int64) + 1
        return self.pack_rows(ints, [len(tokens) for tokens in self.tokens])

    def run(self, logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * width] int64: each row's emitted tokens (the first num_accepted + 1 count), num_accepted, then
        the fed positions of the kept path after the root (the first num_accepted count)."""
        rows, width, vocab = logits.shape
        k = width - 1
        ints, count, position, batch = unpack(inputs, rows, 3 * k + 1 + COLUMNS, vocab, self.sampled)
        tokens, parents, fed_depth = ints[:, :k], ints[:, k : 2 * k], ints[:, 2 * k : 3 * k + 1]
        no_drafts = torch.zeros_like(count)
        log_p = processed_log_probs(logits, batch, tokens, no_drafts)  # [rows, width, V]
        samples = coupled_samples(log_p, position[:, None] + fed_depth, batch)  # [rows, width]: y per fed position
        nodes = torch.arange(k, device=logits.device)
        real = nodes[None, :] < count[:, None]  # [rows, k]
        matches = real & (tokens == samples.gather(1, parents + 1))  # a padded node's parent -1 reads y at the root
        accepted = torch.zeros_like(matches)
        for node in range(k):  # parents come first: each node's is decided when it is reached
            parent = parents[:, node]
            parent_accepted = accepted.gather(1, parent.clamp_min(0)[:, None]).squeeze(1) | (parent < 0)
            accepted[:, node] = matches[:, node] & parent_accepted
        depth = fed_depth[:, 1:]  # [rows, k]: a node's depth below the root, 1 for the root's children
        num_accepted = accepted.sum(dim=1)  # [rows]: one accepted node a depth, so the accepted path's length
        # the accepted path node by node: slot j holds the accepted node of depth j + 1
        on_slot = accepted[:, None, :] & (depth[:, None, :] == (nodes + 1)[None, :, None])  # [rows, slot, node]
        path_tokens = (on_slot * tokens[:, None, :]).sum(dim=2)  # [rows, k]
        path_fed = (on_slot * (nodes + 1)[None, None, :]).sum(dim=2)  # [rows, k]: node i is fed position i + 1
        last_fed = torch.cat([path_fed.new_zeros(rows, 1), path_fed], dim=1).gather(1, num_accepted[:, None])
        bonus = samples.gather(1, last_fed)  # [rows, 1]: y after the path's last node (the root's: no node kept)
        slots = torch.arange(width, device=logits.device)
        emitted = torch.where(slots[None, :] < num_accepted[:, None],
                              torch.cat([path_tokens, torch.zeros_like(bonus)], dim=1), bonus)  # [rows, width]
        return torch.cat([emitted, num_accepted[:, None], path_fed], dim=1)

    @staticmethod
    def read(result: Sequence[int]) -> tuple[list[int], int, list[int]]:
        """A row of run()'s output on the host: (the emitted tokens, num_accepted, the kept fed positions with the
        root's first)."""
        width = len(result) // 2
        num_accepted = result[width]
        return list(result[: num_accepted + 1]), num_accepted, [0, *result[width + 1 : width + 1 + num_accepted]]

