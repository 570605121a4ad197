"""Protobuf <-> dataclass translation for the Drafter link (proto/specserve/v1/drafter.proto).

Both ends of the link need it (the drafter's servicer and the verifier's RemoteProposer), and services never
import each other, so it lives in common/. Everything here is a small pure function: the servicer and the
client hold the state, this module only changes representation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from services.common.proposer import DECLARES_NOTHING, ProposerCapabilities
from services.common.protos import load

if TYPE_CHECKING:
    import torch

drafter_pb2, drafter_pb2_grpc = load("drafter")


@dataclass(frozen=True)
class DrafterDescription:
    """DrafterInfo: the method's label and what the drafter declares (a verifier checks it before it trusts the
    drafter's token ids)."""

    method: str
    capabilities: ProposerCapabilities = DECLARES_NOTHING


@dataclass(frozen=True)
class SequenceUpdate:
    seq_id: str
    base_length: int  # committed tokens the drafter is assumed to hold; 0 (re)opens the sequence
    new_token_ids: tuple[int, ...]
    num_speculative_tokens: int
    # float16 [rows, H]: target states of the committed tokens the drafter has none for yet (see the proto)
    hidden_states: np.ndarray | None = None
    draft_pipelining: bool | None = None  # pre-draft the next step; None: the drafter's own setting
    temperature: float = 0.0  # the request's sampling temperature; 0: greedy (see the proto)


@dataclass(frozen=True)
class SequenceDraft:
    seq_id: str
    base_length: int  # committed length the proposal continues from
    token_ids: tuple[int, ...] = ()
    probs: torch.Tensor | None = None  # [len(token_ids), V], or [len(token_ids), len(probs_token_ids)]
    resync_needed: bool = False
    parents: tuple[int, ...] | None = None  # a token tree (Draft.parents); None: a chain
    path_probs: tuple[float, ...] | None = None  # with a tree, optional (Draft.path_probs)
    probs_token_ids: tuple[int, ...] = ()  # the token ids probs covers; (): all (see the proto)


@dataclass(frozen=True)
class DraftStep:
    step_id: int
    updates: tuple[SequenceUpdate, ...] = ()
    closed_seq_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class DraftReply:
    step_id: int
    drafts: tuple[SequenceDraft, ...] = field(default_factory=tuple)


# -- tensors ------------------------------------------------------------------------------------------------
def encode_probs(probs: torch.Tensor | None) -> bytes:
    """[N, V] float tensor -> little-endian float16 bytes (empty for None)."""
    if probs is None:  # every draft of an ngram or suffix drafter, whose image has no torch
        return b""
    import torch  # here, not at the top: only a drafter that samples (and so has torch) sends probabilities

    return probs.detach().to("cpu", torch.float16).contiguous().numpy().astype("<f2", copy=False).tobytes()


def decode_probs(data: bytes, num_tokens: int) -> torch.Tensor | None:
    """Little-endian float16 bytes -> [num_tokens, V] float32; None when absent or not a whole matrix."""
    if not data or num_tokens == 0:  # every draft of a drafter that sends none: no array made for nothing
        return None
    values = np.frombuffer(data, dtype="<f2")
    if values.size % num_tokens:
        return None
    import torch  # the verifier's side, which has torch; see encode_probs

    return torch.from_numpy(values.astype(np.float32).reshape(num_tokens, -1))


def probs_support(probs: torch.Tensor | None) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """q as sent: over the token ids some row gives probability when they are at most half the vocabulary (a
    drafter with a reduced vocabulary), else whole. Returns (the columns sent, their token ids; () for all)."""
    if probs is None:
        return None, ()
    support = probs.detach().ne(0).any(dim=0).nonzero().flatten()
    if 2 * support.numel() > probs.shape[-1]:
        return probs, ()
    return probs[:, support], tuple(support.tolist())


def dense_probs(probs: torch.Tensor | None, token_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor | None:
    """[rows, V] q from what the wire carried: `probs` over `token_ids` (or over every token when empty); None when
    it does not fit the vocabulary (the drafts are then verified as deterministic ones)."""
    if probs is None or not token_ids:
        return probs
    if probs.shape[-1] != len(token_ids) or max(token_ids) >= vocab_size:
        return None
    import torch  # the verifier's side; see encode_probs

    dense = probs.new_zeros(probs.shape[0], vocab_size)
    dense[:, torch.tensor(token_ids)] = probs
    return dense


# -- Info ---------------------------------------------------------------------------------------------------
def description_to_proto(info: DrafterDescription):
    declared = info.capabilities
    return drafter_pb2.DrafterInfo(
        method=info.method,
        vocab_size=declared.vocab_size,
        tokenizer_fingerprint=declared.tokenizer_fingerprint,
        needs_hidden_states=declared.needs_hidden_states,
        max_speculative_tokens=declared.max_speculative_tokens,
        hidden_size=declared.hidden_size,
        hidden_layers=declared.hidden_layers if declared.needs_hidden_states else (),
        pre_drafts=declared.pre_drafts,
        sends_trees=declared.sends_trees,
    )


def description_from_proto(message) -> DrafterDescription:
    return DrafterDescription(message.method, ProposerCapabilities(
        vocab_size=message.vocab_size,
        tokenizer_fingerprint=message.tokenizer_fingerprint,
        needs_hidden_states=message.needs_hidden_states,
        max_speculative_tokens=message.max_speculative_tokens,
        hidden_size=message.hidden_size,
        hidden_layers=tuple(message.hidden_layers) or (-1,),
        pre_drafts=message.pre_drafts,
        sends_trees=message.sends_trees,
    ))


# -- Draft (verifier -> drafter) ----------------------------------------------------------------------------
def step_to_proto(step: DraftStep):
    # each update added in place (building a SequenceUpdate message and then the list copied each one again)
    message = drafter_pb2.DraftRequest(step_id=step.step_id, closed_seq_ids=step.closed_seq_ids)
    add = message.updates.add
    for u in step.updates:
        add(seq_id=u.seq_id, base_length=u.base_length, new_token_ids=u.new_token_ids,
            num_speculative_tokens=u.num_speculative_tokens,
            hidden_states_fp16=b"" if u.hidden_states is None else u.hidden_states.astype("<f2").tobytes(),
            hidden_size=0 if u.hidden_states is None else u.hidden_states.shape[1],
            draft_pipelining=u.draft_pipelining, temperature=u.temperature)
    return message


def step_from_proto(message) -> DraftStep:
    return DraftStep(
        step_id=message.step_id,
        updates=tuple(
            SequenceUpdate(u.seq_id, u.base_length, tuple(u.new_token_ids), u.num_speculative_tokens,
                           decode_hidden(u.hidden_states_fp16, u.hidden_size),
                           u.draft_pipelining if u.HasField("draft_pipelining") else None, u.temperature)
            for u in message.updates
        ),
        closed_seq_ids=tuple(message.closed_seq_ids),
    )


# -- Draft (drafter -> verifier) ----------------------------------------------------------------------------
def reply_to_proto(reply: DraftReply):
    message = drafter_pb2.DraftResponse(step_id=reply.step_id)
    add = message.drafts.add  # each draft added in place, as step_to_proto's updates
    for d in reply.drafts:
        add(seq_id=d.seq_id, base_length=d.base_length, token_ids=d.token_ids,
            probs_fp16=encode_probs(d.probs), resync_needed=d.resync_needed,
            parents=d.parents or (), path_probs=d.path_probs or (), probs_token_ids=d.probs_token_ids)
    return message


def reply_from_proto(message) -> DraftReply:
    # positional fields, no keywords: the verifier reads a reply of every running row each step it drafts
    return DraftReply(message.step_id, tuple(
        SequenceDraft(d.seq_id, d.base_length, tuple(d.token_ids), decode_probs(d.probs_fp16, len(d.token_ids)),
                      d.resync_needed, tuple(d.parents) or None, tuple(d.path_probs) or None,
                      tuple(d.probs_token_ids))
        for d in message.drafts
    ))


def decode_hidden(data: bytes, hidden_size: int) -> np.ndarray | None:
    """float16 [rows, hidden_size], or None when nothing (or nothing well-formed) was sent."""
    if not data or not hidden_size or len(data) % (2 * hidden_size):
        return None
    return np.frombuffer(data, dtype="<f2").reshape(-1, hidden_size)


def new_hidden_rows(states, base_length: int, num_committed: int):
    """The rows a peer holding `base_length` committed tokens (states for all but its last) is missing, of
    `states` [>= num_committed - 1, H] (row i: token i; a numpy array or a torch tensor), once `num_committed`
    tokens are committed."""
    return states[max(base_length - 1, 0) : num_committed - 1]


def new_tokens(committed: Sequence[int], base_length: int, end: int | None = None) -> tuple[int, ...]:
    """The committed tokens a peer that holds `base_length` of them is missing (up to `end`: all of them)."""
    return tuple(int(t) for t in committed[base_length:end])
