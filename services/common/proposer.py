"""The one proposer protocol every drafter implements (ngram, suffix, draft model, EAGLE, or a remote drafter
reached over gRPC). The verifier engine talks to proposers only through this protocol and never branches on
the method name.

Each engine step calls `propose` once per proposer with every running sequence that uses it. The call is async
so that a remote drafter can await the network; the engine bounds it with a deadline and runs a sequence with
K = 0 when its proposal is missing. Sequences are identified by id; `token_ids` always holds the whole committed
sequence (prompt + output), so a stateful proposer can derive what changed since the last step and resync when
it has lost track.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # only drafters that sample carry tensors: ngram and suffix drafters run without torch
    import torch


@dataclass(frozen=True)
class DraftInput:
    seq_id: Hashable
    token_ids: Sequence[int]  # committed tokens, prompt first; read-only
    # K wanted now (the engine already clamped it to the room left): a chain's length, or the most tokens a tree may
    # hold (Draft.parents; its depth is the drafter's own num_speculative_tokens)
    num_speculative_tokens: int
    # For proposers that declare `needs_hidden_states` (EAGLE): the target's final hidden states of the committed
    # tokens it has run on, [n, H], row i belonging to token_ids[i]. n = len(token_ids) - 1: the last committed
    # token (the bonus one) has not been through the target yet; its state comes with the next step.
    hidden_states: torch.Tensor | None = None
    # For proposers that pre-draft (`pre_drafts`, draft_model and EAGLE): draft this sequence's next step while
    # the verifier verifies this one (the request's draft_pipelining); None: the proposer's own setting.
    pipelining: bool | None = None


@dataclass(frozen=True)
class Draft:
    token_ids: Sequence[int]  # at most K proposed tokens (fewer, or none, is fine)
    probs: torch.Tensor | None = None  # [len(token_ids), V] q, only from drafters that really sample
    # A token tree instead of a chain: parents[i] is the index in token_ids of token i's parent, -1 for a token
    # that follows the committed ones; parents come before their children, so the first k tokens are a tree too
    # (K counts tokens, i.e. the verify width, as for a chain). None: a chain. Trees are verified as
    # deterministic drafts (their probs are not used).
    parents: Sequence[int] | None = None


class Proposer(Protocol):
    method: str  # label for stats and metrics, never for control flow

    async def propose(self, inputs: Sequence[DraftInput]) -> Sequence[Draft]:
        """One draft per input, in order."""

    def release(self, seq_id: Hashable) -> None:
        """The sequence finished or was aborted; forget it."""


def declared_vocabulary(proposer: object) -> tuple[int, str]:
    """(vocab_size, tokenizer_fingerprint) a proposer proposes from, as the drafter declares them in Info.

    A proposer that drafts with a model of its own (draft_model, EAGLE) has `vocab_size` and
    `tokenizer_fingerprint` attributes, so that a verifier with another vocabulary refuses it before any
    token id is exchanged. One that only copies token ids the verifier committed (ngram, suffix) has neither
    and declares (0, ""): it works on any vocabulary. Optional attributes rather than protocol members, so that
    every existing proposer, plug-ins included, stays a Proposer."""
    return int(getattr(proposer, "vocab_size", 0) or 0), str(getattr(proposer, "tokenizer_fingerprint", "") or "")


def vocabulary_mismatch(drafts_from: tuple[int, str], target: tuple[int, str]) -> str | None:
    """Why a proposer declaring `drafts_from` = (vocab_size, tokenizer_fingerprint) cannot draft for a target with
    `target` = (vocab_size, fingerprint), or None if it can. 0 and "" mean undeclared (any vocabulary, unknown
    tokenizer). One rule for a drafter reached over gRPC and one built in-process.

    When both sides have a fingerprint, it decides alone: the same token -> id map means every id either side can
    produce means the same text, whatever size the embedding tables were padded to (Qwen2.5-0.5B has 151936 rows,
    the 7B 152064, one tokenizer); an id past the other side's table never reaches it (the verifier drops such
    drafts, the drafter does not draft a sequence holding one). Without fingerprints, sizes must be equal."""
    (vocab, fingerprint), (target_vocab, target_fingerprint) = drafts_from, target
    if fingerprint and target_fingerprint:
        if fingerprint != target_fingerprint:
            return (f"uses a different tokenizer (fingerprint {fingerprint[:12]} vs the target's "
                    f"{target_fingerprint[:12]})")
        return None
    if vocab and vocab != target_vocab:
        return f"proposes from a vocabulary of {vocab} tokens but the target model has {target_vocab}"
    return None
