"""Prompt-lookup (n-gram) drafting: find the sequence's last n tokens earlier in the sequence and propose what
followed them there. Free to compute, and very effective when the output copies from the prompt (code edits,
summaries, RAG). Same knobs as vLLM's `ngram` method.

With `num_draft_tokens` it sends a token tree instead (propose_ngram_tree): the continuations of every earlier
occurrence of that n-gram, most recent first, merged where they agree. A text that repeats with variations (a
list, a table, code with similar branches) then has its likeliest variations verified together, and the tree's
first path is the chain the method would send otherwise."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from services.common.prompt_lookup import NgramSettings, propose_ngram
from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.common.speculative_config import SpeculativeConfig


def _longest_match_ends(tokens: np.ndarray, settings: NgramSettings) -> np.ndarray:
    """Where the earlier occurrences of the longest matching suffix n-gram (n from prompt_lookup_max down to
    prompt_lookup_min) end, in order (empty: none); what followed an occurrence starts one past its end.

    One scan, then narrowing: the occurrences of the last token before it, then of those the ones whose previous
    token continues the suffix, and so on while any is left. A scan of the whole sequence per n, as this was,
    cost 0.2-0.8 ms a sequence at 300-4,000 tokens on a 2-core EPYC, paid every step for every row (20 ms a step
    at 64 rows); this is one comparison over the sequence and a few on a shrinking handful of positions."""
    length = len(tokens)
    if length < 2 or settings.prompt_lookup_max < 1:
        return np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # occurrences of the 1-gram, not itself
    n, found = 1, ends
    while ends.size and n < settings.prompt_lookup_max:
        ends = ends[ends >= n]  # an (n + 1)-gram ending at i starts at i - n
        ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
        if ends.size:
            n, found = n + 1, ends
    if not found.size or n < settings.prompt_lookup_min:
        return np.zeros(0, dtype=np.int64)
    return found


MAX_TREE_MATCHES = 64  # the most recent occurrences a tree reads: enough to fill any tree, bounded per step


def _longest_match_starts(tokens: np.ndarray, settings: NgramSettings) -> np.ndarray:
    """Where the continuations of the longest matching suffix n-gram start, most recent first (empty: none)."""
    return _longest_match_ends(tokens, settings)[::-1] + 1


def propose_ngram_tree(tokens: np.ndarray, max_nodes: int, depth: int, settings: NgramSettings) -> Draft:
    """A token tree of at most `max_nodes` tokens, paths at most `depth` long: the continuations of the most
    recent earlier occurrences of the longest matching suffix n-gram (MAX_TREE_MATCHES at most), most recent
    first, merged into a trie (a continuation shares the nodes of those before it that it agrees with). A node
    comes after its parent and its first child continues the more recent occurrence, so the first path is
    propose_ngram's chain. path_probs: each node's share of the occurrences that run through it."""
    if max_nodes <= 0 or depth <= 0:
        return Draft(())
    starts = _longest_match_starts(tokens, settings)[:MAX_TREE_MATCHES]
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    nodes: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    for start in starts.tolist():
        parent = -1
        for token in tokens[start : start + depth].tolist():
            node = children.get((parent, token))
            if node is None:
                if len(nodes) == max_nodes:
                    break
                node = children[(parent, token)] = len(nodes)
                nodes.append(token)
                parents.append(parent)
                counts.append(0)
            counts[node] += 1
            parent = node
    if not nodes:
        return Draft(())
    return Draft(tuple(nodes), parents=tuple(parents), path_probs=tuple(c / len(starts) for c in counts))


class NgramProposer:
    method = "ngram"

    def __init__(self, settings: NgramSettings | None = None, tree_depth: int | None = None) -> None:
        """tree_depth: send token trees whose paths are at most this long (num_draft_tokens set; each call's K
        bounds the tree's tokens); None: chains."""
        self.settings = settings or NgramSettings()
        self.tree_depth = tree_depth
        self.capabilities = ProposerCapabilities(sends_trees=tree_depth is not None)  # any vocabulary

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        if self.tree_depth is not None:
            return [propose_ngram_tree(np.asarray(item.token_ids, dtype=np.int64), item.num_speculative_tokens,
                                       self.tree_depth, self.settings) for item in inputs]
        return [
            Draft(propose_ngram(np.asarray(item.token_ids, dtype=np.int64), item.num_speculative_tokens, self.settings))
            for item in inputs
        ]

    def release(self, seq_id: Hashable) -> None:
        """Stateless: nothing to forget."""


def build_proposer(config: SpeculativeConfig) -> NgramProposer:
    """The registry's entry point (services/common/drafter_methods.py)."""
    options = config.options  # NgramOptions (services/common/method_options.py)
    return NgramProposer(NgramSettings(options.prompt_lookup_min, options.prompt_lookup_max),
                         config.num_speculative_tokens if config.sends_trees else None)
