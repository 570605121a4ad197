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
    # committed tokens, prompt first; read-only (a TokenView from the engine and the drafter service alike:
    # np.asarray reads it uncopied, and it does not change when the sequence grows)
    token_ids: Sequence[int]
    # K wanted now (the engine already clamped it to the room left): a chain's length, or the most tokens a tree may
    # hold (Draft.parents; its depth is the drafter's own num_speculative_tokens)
    num_speculative_tokens: int
    # For proposers that declare needs_hidden_states (EAGLE): the target's final hidden states of the committed
    # tokens it has run on, [n, H], row i belonging to token_ids[i]. n = len(token_ids) - 1: the last committed
    # token (the bonus one) has not been through the target yet; its state comes with the next step. Any float
    # dtype, on any device (a view of the history, read-only): a proposer converts the rows it reads, not all n.
    hidden_states: torch.Tensor | None = None
    # For proposers that declare pre_drafts (draft_model and EAGLE): draft this sequence's next step while
    # the verifier verifies this one (the request's draft_pipelining); None: the proposer's own setting.
    pipelining: bool | None = None
    # The request's sampling temperature, 0 for a greedy one: a proposer that samples its drafts (EAGLE's q-trees)
    # draws at it and sends q; deterministic proposers ignore it.
    temperature: float = 0.0
    # The request's predicted output (OpenAI's `prediction`, as token ids) for the verifier's built-in prediction
    # proposer (services/verifier/prediction_proposer.py), and how many of token_ids are the prompt (the output is
    # what the prediction is lined up with); empty and 0 without one. Other proposers ignore both.
    prediction: Sequence[int] = ()
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class Draft:
    token_ids: Sequence[int]  # at most K proposed tokens (fewer, or none, is fine)
    probs: torch.Tensor | None = None  # [len(token_ids), V] q, only from drafters that really sample
    # A token tree instead of a chain: parents[i] is the index in token_ids of token i's parent, -1 for a token
    # that follows the committed ones; parents come before their children, so the first k tokens are a tree too
    # (K counts tokens, i.e. the verify width, as for a chain). None: a chain. Without probs a tree is verified as
    # deterministic drafts, lossless for any tree. With probs (a q-tree, from a drafter that samples): probs[i] is
    # the distribution node i was drawn from, its parent's, the same for all siblings; each node's children were
    # drawn from it without replacement and are listed in the order drawn, and whether a child is sent must not
    # depend on its own token (send a prefix of each node's draws). Sampled requests then accept by multi-draft
    # rejection sampling (services/verifier/tree_rejection.py), which accepts more often when q is close to the
    # target.
    parents: Sequence[int] | None = None
    # With parents and no probs, optionally: each token's probability under the drafter that the continuation runs
    # through it (the product of its path's draft probabilities). The verifier's planner ranks a tree's nodes by it
    # when it cuts the tree to what is worth verifying; acceptance never reads it, so any value is lossless. (A
    # q-tree's are ignored: cutting its nodes by their own likelihood would bias the draws its acceptance sees.)
    path_probs: Sequence[float] | None = None


@dataclass(frozen=True)
class ProposerCapabilities:
    """What a proposer declares beyond the protocol's members: the verifier reads it (in-process, or from a remote
    drafter's Info) to decide what to send and what to trust. The defaults describe a plain chain drafter that
    copies committed token ids (ngram): any vocabulary, no hidden states, no pre-drafts, no trees."""

    # The vocabulary it proposes from (a draft model's own), checked against the target's before any token id is
    # exchanged (vocabulary_mismatch); 0 and "": any vocabulary, no tokenizer (it copies committed ids)
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""
    # It reads the target's hidden states (EAGLE): DraftInput.hidden_states, from the layers in hidden_layers
    # (-1: the final, normed one), of width hidden_size (0: not checked)
    needs_hidden_states: bool = False
    hidden_size: int = 0
    hidden_layers: tuple[int, ...] = (-1,)
    # It drafts a sequence's next step while the verifier verifies this one, so a request may set
    # draft_pipelining (draft_model, eagle)
    pre_drafts: bool = False
    # Its drafts may be token trees (Draft.parents); a tree from a proposer that does not declare this is cut to
    # its first path. Then K (DraftInput.num_speculative_tokens) is the tokens a tree may hold.
    sends_trees: bool = False
    # The most draft tokens it answers per sequence and step (0: no limit of its own); the engine asks no more
    max_speculative_tokens: int = 0

    @property
    def state_width(self) -> int:
        """The width of the target states it reads a token (its layers side by side); 0 for one that reads none."""
        return self.hidden_size * len(self.hidden_layers) if self.needs_hidden_states else 0

    @property
    def vocabulary(self) -> tuple[int, str]:
        """(vocab_size, tokenizer_fingerprint), as vocabulary_mismatch compares them."""
        return self.vocab_size, self.tokenizer_fingerprint


DECLARES_NOTHING = ProposerCapabilities()


def capabilities_of(proposer: object) -> ProposerCapabilities:
    """What `proposer` declares: its `capabilities` attribute, optional so that a plug-in written against the
    three protocol members stays a Proposer (it declares nothing). A remote drafter not reached yet declares
    nothing so far (see capabilities_known)."""
    return getattr(proposer, "capabilities", DECLARES_NOTHING) or DECLARES_NOTHING


def capabilities_known(proposer: object) -> bool:
    """False for a remote drafter not reached yet (its `capabilities` is None): where a request depends on one
    (draft_pipelining), it gets the benefit of the doubt and runs at K = 0 meanwhile."""
    return getattr(proposer, "capabilities", DECLARES_NOTHING) is not None


class Proposer(Protocol):
    """The three members every proposer has; what it can do beyond them it declares as `capabilities`
    (ProposerCapabilities, read through capabilities_of)."""

    method: str  # label for stats and metrics, never for control flow

    async def propose(self, inputs: Sequence[DraftInput]) -> Sequence[Draft]:
        """One draft per input, in order."""

    def release(self, seq_id: Hashable) -> None:
        """The sequence finished or was aborted; forget it."""


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
