"""The Drafter gRPC servicer: a thin shell that lets any Proposer serve verifiers over the network.

Sequence state belongs to the Draft stream that opened it: each verifier link has its own table, a broken link
takes its sequences with it (released from the proposer), and two verifiers using the same sequence id do not
collide, because the proposer sees ids namespaced by link. The servicer keeps the committed tokens of every
open sequence so that proposers keep receiving whole sequences (the Proposer protocol's contract), exactly as
they do in-process; it keeps them in numpy buffers and hands them over as read-only views (token_history.py), so
that a drafter reading them with numpy copies nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.common.drafter_wire import (
    DrafterDescription,
    DraftReply,
    DraftStep,
    SequenceDraft,
    description_to_proto,
    drafter_pb2_grpc,
    probs_support,
    reply_to_proto,
    step_from_proto,
)
from services.common.growing_rows import GrowingRows
from services.common.proposer import DraftInput, Proposer
from services.common.token_history import TokenHistory
from services.drafter.metrics import DrafterMetrics, StepObservation

logger = logging.getLogger(__name__)


@dataclass
class LinkState:
    """What one Draft stream has told the drafter: the committed tokens of each open sequence."""

    link_id: int
    sequences: dict[str, TokenHistory] = field(default_factory=dict)
    # The target's hidden states of each sequence's committed tokens but the last, as received (float16 rows;
    # growing_rows.py: a step appends its rows without copying the history); kept only for a drafter that needs them.
    hidden: dict[str, GrowingRows] = field(default_factory=dict)

    def hidden_states(self, seq_id: str) -> np.ndarray | None:
        rows = self.hidden.get(seq_id)
        return None if rows is None else rows.view()

    def key(self, seq_id: str) -> tuple[int, str]:
        return (self.link_id, seq_id)


def apply_step(link: LinkState, step: DraftStep) -> tuple[list[SequenceDraft | None], list[str]]:
    """Apply a step's updates to `link`. Returns, per update, a ready answer (resync) or None (draft it), and
    the ids whose state was dropped (to release in the proposer). Pure apart from mutating `link`."""
    answers: list[SequenceDraft | None] = []
    dropped: list[str] = []
    for seq_id in step.closed_seq_ids:
        link.hidden.pop(seq_id, None)
        if link.sequences.pop(seq_id, None) is not None:
            dropped.append(seq_id)
    for update in step.updates:
        known = link.sequences.get(update.seq_id)
        if update.base_length == 0:
            if known is not None:
                dropped.append(update.seq_id)  # re-opened: the proposer starts afresh
            link.sequences[update.seq_id] = TokenHistory(update.new_token_ids)
            link.hidden[update.seq_id] = GrowingRows(update.hidden_states)
        elif known is None or len(known) != update.base_length:
            if known is not None:
                del link.sequences[update.seq_id]
                dropped.append(update.seq_id)
            answers.append(SequenceDraft(update.seq_id, update.base_length, resync_needed=True))
            continue
        else:
            known.extend(update.new_token_ids)
            if update.hidden_states is not None:
                link.hidden.setdefault(update.seq_id, GrowingRows()).append(update.hidden_states)
        answers.append(None)
    return answers, dropped


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self, proposer: Proposer, description: DrafterDescription, metrics: DrafterMetrics | None = None
    ) -> None:
        self.proposer = proposer
        self.description = description
        self.metrics = metrics
        self._link_ids = itertools.count(1)
        self._links: dict[int, LinkState] = {}
        if metrics is not None:
            metrics.watch_links(lambda: [len(link.sequences) for link in list(self._links.values())])

    async def Info(self, request, context: grpc.aio.ServicerContext):
        return description_to_proto(self.description)

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        link = LinkState(next(self._link_ids))
        self._links[link.link_id] = link
        try:
            async for message in request_iterator:
                started = time.perf_counter()
                reply = await self._step(link, step_from_proto(message))
                if self.metrics is not None:
                    self.metrics.observe_step(_observation(reply, time.perf_counter() - started))
                yield reply_to_proto(reply)
        finally:
            del self._links[link.link_id]
            for seq_id in link.sequences:  # the verifier went away: nothing will close these
                self.proposer.release(link.key(seq_id))

    def _hidden_states(self, link: LinkState, seq_id: str):
        """A torch [n, H] float16 view of the sequence's states for a drafter that needs them (it has torch); the
        drafter converts the rows it reads, where converting the whole history each step grew with the context."""
        if not self.description.capabilities.needs_hidden_states:
            return None
        states = link.hidden_states(seq_id)
        if states is None:
            return None
        import torch

        return torch.from_numpy(states)

    async def _step(self, link: LinkState, step: DraftStep) -> DraftReply:
        answers, dropped = apply_step(link, step)
        for seq_id in dropped:
            self.proposer.release(link.key(seq_id))
        pending = [i for i, answer in enumerate(answers) if answer is None]
        inputs = []
        for i in pending:
            update = step.updates[i]
            k = update.num_speculative_tokens
            limit = self.description.capabilities.max_speculative_tokens
            if limit:  # a verifier asks for no more (DrafterInfo); this guards the link against one that does
                k = min(k, limit)
            inputs.append(DraftInput(link.key(update.seq_id), link.sequences[update.seq_id].view(), k,
                                     self._hidden_states(link, update.seq_id), update.draft_pipelining,
                                     update.temperature))
        wanted = [j for j, item in enumerate(inputs) if item.num_speculative_tokens > 0]
        proposed = list(await self.proposer.propose([inputs[j] for j in wanted])) if wanted else []
        if len(proposed) != len(wanted):
            raise RuntimeError(
                f"proposer {self.proposer.method!r} returned {len(proposed)} drafts for {len(wanted)}"
            )
        by_input = dict(zip(wanted, proposed, strict=True))
        for j, i in enumerate(pending):
            update, draft = step.updates[i], by_input.get(j)
            probs, probs_token_ids = probs_support(draft.probs if draft else None)
            answers[i] = SequenceDraft(
                update.seq_id,
                len(inputs[j].token_ids),
                tuple(int(t) for t in draft.token_ids) if draft else (),
                probs,
                parents=tuple(int(p) for p in draft.parents) if draft and draft.parents is not None else None,
                path_probs=tuple(float(p) for p in draft.path_probs)
                if draft and draft.parents is not None and draft.path_probs is not None else None,
                probs_token_ids=probs_token_ids,
            )
        return DraftReply(step.step_id, tuple(answers))


def _observation(reply: DraftReply, seconds: float) -> StepObservation:
    return StepObservation(
        seconds,
        len(reply.drafts),
        sum(len(draft.token_ids) for draft in reply.drafts),
        sum(1 for draft in reply.drafts if draft.resync_needed),
    )
