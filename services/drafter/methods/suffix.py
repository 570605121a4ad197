"""Suffix decoding (`--method suffix`): draft from suffix trees over the request's own tokens and over every
response seen before, as vLLM's and SGLang's `suffix` method do, with Snowflake's arctic-inference.

Why arctic-inference: its SuffixDecodingCache is a C++ suffix tree (nanobind) that extends a sequence in
O(depth) per token and matches a context and walks the most frequent continuation in microseconds, without
copying the sequence; a Python suffix structure would cost more than the verify step saves. The same tree
serves two roles here:

* a per-request tree over the request's prompt and output (like prompt lookup, but every earlier occurrence of
  the context votes, so a draft follows the most frequent continuation, not just the most recent one);
* one global tree over the responses of all requests, finished or running (bounded by
  suffix_decoding_max_cached_requests, oldest evicted first). Agentic loops, retries and templated tasks make
  models repeat earlier outputs, and the global tree drafts those repeats from the first step.

The global tree is why this method pays off more here than inside one engine: the drafter is its own service,
so its tree is shared by every verifier connected to it, and every verifier's requests feed and use the same
history.

The draft length adapts to how much context matched: at most max_spec_factor * match length tokens, each
drafted token's estimated probability (frequency along the path) at least min_token_prob, and never more than
the K the sequence asks for now. A match and its draft together fit in max_tree_depth, so at the default
depth 24 and factor 1.0 no draft is longer than 12 tokens whatever K is. Drafts are deterministic (no q); the
verifier checks every drafted token, so draft quality changes speed only, never the output.

State per sequence: the proposer only sees whole committed sequences (the Proposer protocol), so it keeps how
many tokens of each sequence are in the trees and adds what is new each step. A view that does not extend the
last one (a rollback or a resync) restarts the sequence's trees from the new view, dropping what the old view
put in the global tree. The first view of a sequence is its prompt (with, from the engine, the first output
token): all of it goes into the request's tree, and its last max_tree_depth tokens also into the global tree,
ahead of the response, so that a later request that ends with the same context finds this response's start
(vLLM puts only output tokens in the global tree; it knows where the prompt ends, the protocol does not say).

arctic-inference is imported lazily (by SuffixProposer, hence build_proposer): importing this module never
fails, and where the package is missing build_proposer raises MethodUnavailableError saying how to install it.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

import numpy as np

from services.common.drafter_methods import MethodUnavailableError
from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.common.token_trees import nodes_to_depth, renumbered_parents

if TYPE_CHECKING:
    from services.common.speculative_config import SpeculativeConfig

PACKAGE = "arctic-inference"


@dataclass(frozen=True)
class SuffixSettings:
    """The knobs of vLLM's suffix method (SuffixOptions' suffix_decoding_*), plus how much of a
    sequence's first view goes into the global tree (None: max_tree_depth; 0: none, as in vLLM)."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10_000  # 0: no global tree; -1: unbounded
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    global_context_tokens: int | None = None
    trees: bool = False  # send the token tree the match grows (num_draft_tokens set) instead of its best path
    tree_depth: int = 64  # a tree's paths hold at most this many tokens (num_speculative_tokens)

    def __post_init__(self) -> None:
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {self.max_tree_depth}")
        if not -1 <= self.max_cached_requests <= 0x7FFFFFFF:
            raise ValueError(
                f"max_cached_requests must be in [-1, 2**31 - 1], got {self.max_cached_requests}"
            )
        if not self.max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.global_context_tokens is not None and self.global_context_tokens < 0:
            raise ValueError(f"global_context_tokens must be >= 0, got {self.global_context_tokens}")

    @property
    def context_into_global(self) -> int:
        return self.max_tree_depth if self.global_context_tokens is None else self.global_context_tokens

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> SuffixSettings:
        options = config.options  # SuffixOptions (services/common/method_options.py)
        return cls(
            max_tree_depth=options.suffix_decoding_max_tree_depth,
            max_cached_requests=options.suffix_decoding_max_cached_requests,
            max_spec_factor=options.suffix_decoding_max_spec_factor,
            min_token_prob=options.suffix_decoding_min_token_prob,
            trees=config.sends_trees,
            tree_depth=config.num_speculative_tokens,
        )


def install_hint() -> str:
    """How to install the pinned arctic-inference (the pin is this project's `suffix` extra)."""
    requirement = PACKAGE
    try:
        for line in metadata.requires("specserve") or ():
            if line.replace("_", "-").lower().startswith(PACKAGE) and "suffix" in line:
                requirement = line.split(";")[0].strip()
    except metadata.PackageNotFoundError:
        pass
    return (
        "run `make install` (it builds it from source, about 30 s), or by hand: "
        "`.venv/bin/pip install setuptools wheel ninja 'cmake>=3.18' nanobind==2.9.2 && "
        f"PATH=$PWD/.venv/bin:$PATH .venv/bin/pip install --no-build-isolation '{requirement}'` "
        "(without build isolation, so that its build uses the installed torch instead of downloading a CUDA one)"
    )


def load_cache_class() -> type:
    """arctic-inference's SuffixDecodingCache, or MethodUnavailableError saying what is missing."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as error:
        raise MethodUnavailableError(
            f"speculative method 'suffix' needs the {PACKAGE} package (its C++ suffix tree), which cannot be "
            f"imported here ({error}); {install_hint()}. Every other method works without it."
        ) from error
    return SuffixDecodingCache


@dataclass
class _Sequence:
    key: int  # the sequence's request id in the cache (fresh per start, so a reused seq_id evicts nothing)
    length: int  # tokens of the sequence already in the trees
    tail: np.ndarray  # its last max_tree_depth of them: the context to match, and to check the next view


class SuffixProposer:
    method = "suffix"

    def __init__(self, settings: SuffixSettings | None = None) -> None:
        cache_class = load_cache_class()
        self.settings = settings or SuffixSettings()
        self.capabilities = ProposerCapabilities(sends_trees=self.settings.trees)  # any vocabulary
        self._cache = cache_class(
            max_tree_depth=self.settings.max_tree_depth,
            max_cached_requests=self.settings.max_cached_requests,
        )
        self._sequences: dict[Hashable, _Sequence] = {}
        self._keys = itertools.count()

    @property
    def num_active(self) -> int:
        """Sequences with a request tree (seen and not released)."""
        return len(self._sequences)

    @property
    def num_cached_responses(self) -> int:
        """Responses in the global tree (running requests included: each holds a slot from its start)."""
        return len(self._cache.cached_requests)

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [self._propose_one(item) for item in inputs]

    def release(self, seq_id: Hashable) -> None:
        """Drop the request's tree; its response stays in the global tree until evicted."""
        sequence = self._sequences.pop(seq_id, None)
        if sequence is not None:
            self._cache.stop_request(sequence.key)

    def _propose_one(self, item: DraftInput) -> Draft:
        sequence = self._sync(item.seq_id, item.token_ids)
        k = item.num_speculative_tokens
        if k <= 0 or len(item.token_ids) < 2:
            return Draft(())
        result = self._cache.speculate(
            sequence.key,
            sequence.tail,  # the last max_tree_depth tokens: all that a match can use
            max_spec_tokens=k,
            max_spec_factor=self.settings.max_spec_factor,
            min_token_prob=self.settings.min_token_prob,
            use_tree_spec=self.settings.trees,
        )
        if not self.settings.trees:
            return Draft(tuple(int(t) for t in result.token_ids[:k]))
        # Arctic grows the tree best first (a node after its parent, likelier children first) and gives each
        # node's parent with -1 for the root's children: the protocol's own shape. k bounds the nodes (the verify
        # width), num_speculative_tokens the depth.
        parents = [int(p) for p in result.parents[:k]]
        kept = nodes_to_depth(parents, self.settings.tree_depth)
        # arctic's probs: each node's estimated probability (counts along its path), what the verifier ranks by
        return Draft(tuple(int(result.token_ids[i]) for i in kept), parents=tuple(renumbered_parents(parents, kept)),
                     path_probs=tuple(float(result.probs[i]) for i in kept))

    def _sync(self, seq_id: Hashable, token_ids: Sequence[int]) -> _Sequence:
        """Bring the sequence's trees up to `token_ids` (the whole committed sequence). Only the new tokens
        and the last max_tree_depth are read, so a step costs the same however long the sequence is."""
        sequence = self._sequences.get(seq_id)
        if sequence is not None and not self._extends(sequence, token_ids):
            self._drop(seq_id, sequence)
            sequence = None
        if sequence is None:
            return self._start(seq_id, token_ids)
        if len(token_ids) > sequence.length:
            self._cache.add_active_response(sequence.key, _int32(token_ids[sequence.length :]))
            sequence.length = len(token_ids)
            sequence.tail = _int32(token_ids[-self.settings.max_tree_depth :])
        return sequence

    @staticmethod
    def _extends(sequence: _Sequence, token_ids: Sequence[int]) -> bool:
        """`token_ids` starts with what was seen, checked on the last max_tree_depth tokens seen: the context
        every draft is matched from. (An edit further back would only leave stale tokens in the trees, which
        costs draft quality, never correctness.)"""
        if len(token_ids) < sequence.length:
            return False
        seen = sequence.tail
        return bool(np.array_equal(_int32(token_ids[sequence.length - len(seen) : sequence.length]), seen))

    def _start(self, seq_id: Hashable, token_ids: Sequence[int]) -> _Sequence:
        key = next(self._keys)
        tokens = _int32(token_ids)
        split = max(0, len(tokens) - self.settings.context_into_global)
        # The request tree gets the whole first view; the global tree (via add_active_response, which extends
        # both) its last tokens, as the context leading into this response.
        self._cache.start_request(key, tokens[:split])
        if split < len(tokens):
            self._cache.add_active_response(key, tokens[split:])
        sequence = _Sequence(key, len(tokens), tokens[-self.settings.max_tree_depth :].copy())
        self._sequences[seq_id] = sequence
        return sequence

    def _drop(self, seq_id: Hashable, sequence: _Sequence) -> None:
        """A view that does not extend the last one: forget the old history, in the global tree too."""
        del self._sequences[seq_id]
        self._cache.stop_request(sequence.key)
        if sequence.key in self._cache.cached_requests:
            self._cache.evict_cached_response(sequence.key)


def _int32(token_ids: Sequence[int]) -> np.ndarray:
    """A contiguous int32 copy (the ndarray overloads of the cache read it without copying; the caller's
    sequence keeps changing after the call)."""
    return np.array(token_ids, dtype=np.int32)


def build_proposer(config: SpeculativeConfig) -> SuffixProposer:
    return SuffixProposer(SuffixSettings.from_config(config))
