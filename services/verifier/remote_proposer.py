"""A Proposer that lives in another process: the verifier's end of the Drafter gRPC link.

One Draft bidi stream per link, one request/response pair per engine step. Per sequence the link remembers how
many committed tokens it has sent, so a step carries only what the engine committed since (the drafter keeps
the rest). Everything that can go wrong — a drafter that is down, slow, restarted or replaced — surfaces as an
exception from `propose` (the engine then runs those rows with K = 0) and is repaired on a later step:

- a broken stream is dropped together with everything sent on it; the next link re-opens every sequence
  (base_length 0), after an exponential backoff so a dead drafter is not hammered;
- a drafter that lost a sequence answers resync_needed, and the sequence is re-sent whole on the next step;
- every link starts with Info under a deadline, and a drafter whose vocabulary differs is refused.

Responses are read by a background task into a queue, so the engine's deadline can cancel a step without
cancelling the stream; a late answer is recognised by its step_id and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from services.common.drafter_wire import (
    DrafterDescription,
    DraftReply,
    DraftStep,
    SequenceUpdate,
    dense_probs,
    description_from_proto,
    drafter_pb2,
    drafter_pb2_grpc,
    new_hidden_rows,
    new_tokens,
    reply_from_proto,
    step_to_proto,
)
from services.common.proposer import Draft, DraftInput, ProposerCapabilities, vocabulary_mismatch
from services.common.tls import open_channel
from services.modeling.hidden_layers import check_hidden_layers
from services.verifier.hidden_state_budget import HiddenStateBudget

logger = logging.getLogger(__name__)


class DrafterUnavailableError(ConnectionError):
    """The drafter cannot answer now (down, slow, stream broken); speculation resumes when it is back."""


class DrafterLateError(DrafterUnavailableError, TimeoutError):
    """The drafter missed one step's deadline; the link stays up and its late answer is dropped. A TimeoutError
    too, so the engine counts it as a late proposal like its own deadline."""


class IncompatibleDrafterError(RuntimeError):
    """The drafter proposes from a different vocabulary than the target's: its token ids would be wrong."""


@dataclass(frozen=True)
class RemoteProposerConfig:
    target: str  # "host:port"
    vocab_size: int  # the verifier's (target model's) vocabulary size
    tokenizer_fingerprint: str = ""  # the verifier's; compared when both sides have one
    hidden_size: int = 0  # the target's hidden size, for drafters that read its states (0: unknown, not checked)
    num_layers: int = 0  # the target's decoder layers, likewise (0: unknown, not checked)
    info_timeout_s: float = 2.0
    # Its own wait for a step's answer; None: none, the caller's deadline cancels the call (the verifier engine's,
    # which follows what the drafter's calls take: draft_deadline.py).
    step_timeout_s: float | None = 0.45
    stream_lifetime_s: float = 600.0  # the Draft stream's deadline; the link is renewed before it expires
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 2.0
    max_missed_steps: int = 4  # unanswered steps in a row before the link is considered dead
    channel_credentials: grpc.ChannelCredentials | None = None  # TLS to the drafter; None: plaintext
    channel_options: tuple[tuple[str, int], ...] = ()  # beyond the shared link policy (open_channel)
    # The target's hidden states one step sends at most (float16 bytes): a longer backlog, such as a batch of long
    # prompts all starting to decode, is sent over several steps (hidden_state_budget), each sequence drafting
    # again once its states are through, so a step's message stays small and quick (grpc_link_policy.py).
    max_hidden_bytes_per_step: int = 16 * 1024 * 1024


def check_compatible(info: DrafterDescription, config: RemoteProposerConfig,
                     served_layers: tuple[int, ...] | None = None) -> None:
    declared = info.capabilities
    why = vocabulary_mismatch(declared.vocabulary, (config.vocab_size, config.tokenizer_fingerprint))
    if why is None and declared.needs_hidden_states:
        why = hidden_states_mismatch(declared, config.hidden_size, config.num_layers, served_layers)
    if why is not None:
        raise IncompatibleDrafterError(
            f"drafter at {config.target} ({info.method}) {why}; refusing it (use a drafter built for this model)"
        )


def hidden_states_mismatch(info: ProposerCapabilities, hidden_size: int, num_layers: int = 0,
                           served_layers: tuple[int, ...] | None = None) -> str | None:
    """Why this verifier cannot feed a drafter that reads the target's hidden states, or None. `served_layers`:
    the layers the verifier's engine serves, once fixed at start-up (hidden_layers.py); None: not fixed yet."""
    layers = tuple(info.hidden_layers)
    if served_layers is not None and layers != served_layers:
        return (f"reads target layers {list(layers)}, but this verifier serves layers {list(served_layers)} (they "
                f"are fixed at start-up by the drafters reached then, or --hidden-layers: restart the verifier)")
    if num_layers:
        try:
            check_hidden_layers(layers, num_layers)
        except ValueError as error:
            return str(error)
    if hidden_size and info.hidden_size and info.hidden_size != hidden_size:
        return f"was built for target states of width {info.hidden_size}, but the target's are {hidden_size} wide"
    return None


@dataclass
class _Link:
    """One Draft stream and what has been sent on it; dropped as a whole when the stream breaks."""

    call: grpc.aio.StreamStreamCall
    replies: asyncio.Queue  # DraftReply | DrafterUnavailableError, filled by `reader`
    reader: asyncio.Task
    info: DrafterDescription
    opened_at: float
    sent: dict[str, int] = field(default_factory=dict)  # seq_id -> committed tokens the drafter holds
    closed: list[str] = field(default_factory=list)  # released since the last request
    next_step_id: int = 1
    missed_steps: int = 0

    def close(self) -> None:
        self.reader.cancel()
        self.call.cancel()


async def _read_replies(call: grpc.aio.StreamStreamCall, replies: asyncio.Queue) -> None:
    try:
        async for message in call:
            replies.put_nowait(reply_from_proto(message))
        replies.put_nowait(DrafterUnavailableError("the drafter ended the Draft stream"))
    except grpc.aio.AioRpcError as error:
        replies.put_nowait(
            DrafterUnavailableError(f"Draft stream broke: {error.code().name}: {error.details()}")
        )


class RemoteProposer:
    def __init__(self, config: RemoteProposerConfig, method: str = "remote") -> None:
        self.config = config
        self.method = method  # replaced by the drafter's own method once Info has answered
        # likewise: what the drafter declares (hidden states, pre-drafts, trees, its K); None: not known yet
        self.capabilities: ProposerCapabilities | None = None
        self.served_hidden_layers: tuple[int, ...] | None = None  # set by the verifier at start-up (serve_...)
        self._channel: grpc.aio.Channel | None = None
        self._link: _Link | None = None
        self._lock = asyncio.Lock()
        self._backoff_s = 0.0
        self._retry_at = 0.0

    @classmethod
    async def connect(cls, config: RemoteProposerConfig) -> RemoteProposer:
        """A proposer whose drafter has been reached and checked (raises IncompatibleDrafterError or
        grpc.aio.AioRpcError); use at startup to fail fast on a misconfigured drafter."""
        proposer = cls(config)
        await proposer.info()
        return proposer

    async def info(self) -> DrafterDescription:
        """Ask the drafter what it is (under info_timeout_s) and refuse it if it cannot serve this target."""
        stub = drafter_pb2_grpc.DrafterStub(self._get_channel())
        message = await stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=self.config.info_timeout_s)
        described = description_from_proto(message)
        check_compatible(described, self.config, self.served_hidden_layers)
        self.method = described.method
        self.capabilities = described.capabilities  # e.g. the engine then keeps its requests' hidden states
        self._retry_at = 0.0  # it answers and fits: no reason to keep backing off
        return described

    def serve_hidden_layers(self, layers: tuple[int, ...]) -> None:
        """The target layers the verifier serves from now on: a drafter (this one restarted, or reached only now)
        that declares others is refused."""
        self.served_hidden_layers = tuple(layers)

    async def close(self) -> None:
        self._drop_link()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- Proposer protocol ----------------------------------------------------------------------------------
    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        if not inputs:
            return []
        async with self._lock:
            now = time.monotonic()
            if now < self._retry_at:
                raise DrafterUnavailableError(
                    f"drafter at {self.config.target} unavailable; retrying in {self._retry_at - now:.2f}s"
                )
            try:
                link = await self._get_link()
                drafts = await self._exchange(link, inputs)
            except DrafterLateError:
                raise
            except (grpc.aio.AioRpcError, DrafterUnavailableError, IncompatibleDrafterError) as error:
                self._fail()
                if isinstance(error, grpc.aio.AioRpcError):
                    raise DrafterUnavailableError(
                        f"drafter at {self.config.target}: {error.code().name}: {error.details()}"
                    ) from error
                raise
            self._backoff_s = 0.0
            return drafts

    def release(self, seq_id: Hashable) -> None:
        link, key = self._link, str(seq_id)
        if link is not None and link.sent.pop(key, None) is not None:
            link.closed.append(key)

    # -- the link -------------------------------------------------------------------------------------------
    def _get_channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(
                self.config.target, self.config.channel_credentials, list(self.config.channel_options)
            )
        return self._channel

    async def _get_link(self) -> _Link:
        link = self._link
        if link is not None and time.monotonic() - link.opened_at > 0.9 * self.config.stream_lifetime_s:
            self._drop_link()  # renew before the stream's deadline cuts it mid-step
            link = None
        if link is None:
            info = await self.info()
            call = drafter_pb2_grpc.DrafterStub(self._get_channel()).Draft(
                timeout=self.config.stream_lifetime_s
            )
            replies: asyncio.Queue = asyncio.Queue()
            reader = asyncio.create_task(_read_replies(call, replies), name="specserve-drafter-replies")
            link = self._link = _Link(call, replies, reader, info, time.monotonic())
        return link

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def _fail(self) -> None:
        """Forget the link (the drafter then sees every sequence re-opened); back off before the next try."""
        self._drop_link()
        self._backoff_s = min(
            self.config.backoff_max_s, max(self.config.backoff_initial_s, 2 * self._backoff_s)
        )
        self._retry_at = time.monotonic() + self._backoff_s

    async def _exchange(self, link: _Link, inputs: Sequence[DraftInput]) -> list[Draft]:
        updates = []
        states_budget = HiddenStateBudget(self.config.max_hidden_bytes_per_step)
        for item in inputs:
            key, committed = str(item.seq_id), item.token_ids
            base = link.sent.get(key, 0)
            if base > len(committed):
                base = 0  # cannot happen with an append-only engine; re-open rather than send garbage
            hidden, upto, k = None, len(committed), item.num_speculative_tokens
            if link.info.capabilities.needs_hidden_states and item.hidden_states is not None:
                upto = states_budget.take(base, len(committed), item.hidden_states.shape[1])
                if upto < len(committed):
                    k = 0  # part of its backlog only: the drafter catches up and drafts once it has it all
                # only the rows the drafter lacks are converted: the whole history each step grew with the context
                rows = new_hidden_rows(item.hidden_states, base, upto)
                hidden = rows.detach().to("cpu", torch.float16).numpy()
            updates.append(SequenceUpdate(key, base, new_tokens(committed, base, upto), k, hidden,
                                          item.pipelining, item.temperature))
        step = DraftStep(link.next_step_id, tuple(updates), tuple(link.closed))
        link.next_step_id += 1
        try:
            await link.call.write(step_to_proto(step))
        except BaseException as error:
            self._drop_link()  # whether the drafter got the request is unknown: start over on a new link
            if isinstance(error, Exception) and not isinstance(error, grpc.aio.AioRpcError):
                # grpc.aio raises InvalidStateError ("RPC already finished") when the drafter went away
                raise DrafterUnavailableError(f"Draft stream broke while sending: {error}") from error
            raise
        link.closed.clear()
        for update in updates:
            link.sent[update.seq_id] = update.base_length + len(update.new_token_ids)
        reply = await self._await_reply(link, step.step_id)
        return self._drafts_from(link, inputs, reply)

    async def _await_reply(self, link: _Link, step_id: int) -> DraftReply:
        try:
            async with asyncio.timeout(self.config.step_timeout_s):
                while True:
                    item = await link.replies.get()
                    if isinstance(item, DrafterUnavailableError):
                        raise item
                    if item.step_id == step_id:
                        link.missed_steps = 0
                        return item
                    # an answer to a step the engine already gave up on: drop it
        except TimeoutError:
            self._missed(link)
            raise DrafterLateError(
                f"drafter at {self.config.target} did not answer within {self.config.step_timeout_s}s"
            ) from None
        except asyncio.CancelledError:  # the caller's deadline
            self._missed(link)
            raise

    def _missed(self, link: _Link) -> None:
        """A step went unanswered; `max_missed_steps` in a row mean the link is dead: the next call opens
        another (raising here when the wait was the caller's would turn its cancellation into an error)."""
        link.missed_steps += 1
        if link.missed_steps >= self.config.max_missed_steps:
            if self.config.step_timeout_s is not None:
                raise DrafterUnavailableError(
                    f"drafter at {self.config.target} missed {link.missed_steps} steps in a row"
                ) from None
            self._fail()

    def _drafts_from(self, link: _Link, inputs: Sequence[DraftInput], reply: DraftReply) -> list[Draft]:
        if len(reply.drafts) != len(inputs):
            raise DrafterUnavailableError(
                f"drafter answered {len(reply.drafts)} drafts for {len(inputs)} sequences"
            )
        drafts = []
        for item, proposed in zip(inputs, reply.drafts, strict=True):
            key = str(item.seq_id)
            if proposed.seq_id != key:
                raise DrafterUnavailableError(
                    f"drafter answered for {proposed.seq_id!r} where {key!r} was asked"
                )
            if proposed.resync_needed:
                link.sent.pop(key, None)  # re-sent whole on the next step
                drafts.append(Draft(()))
            elif proposed.base_length != len(item.token_ids):
                drafts.append(Draft(()))  # continues some other length: useless now
            else:
                probs = dense_probs(proposed.probs, proposed.probs_token_ids, self.config.vocab_size)
                drafts.append(Draft(proposed.token_ids, probs, proposed.parents, proposed.path_probs))
        return drafts
