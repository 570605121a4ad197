"""The gateway's only way to the verifier: a grpc.aio channel per the contract in proto/specserve/v1.

Every call carries a deadline, so a hung verifier becomes a 503 instead of a hung HTTP request. The channel is
opened lazily inside the running event loop (grpc.aio channels belong to the loop that made them), and
leaving a `generate` iterator early — a stop string, a client disconnect — cancels the call, which tells the
verifier to abort the request and free its KV slot.

A Generate that fails as "unavailable" before its first message (the connection was closed under it: a
verifier restart, a GOAWAY) is re-issued once on a fresh channel: nothing was generated yet, so the client
gets its answer instead of a 503. Once a message has arrived it is never retried (the tokens were sent on).

The address may name several verifiers; the channel balances over them (verifier_target.py), call by call. With
`shared_stream` the requests share GenerateMany calls instead (shared_stream.py), a few for all of them
(shared_stream_pool.py: `shared_stream_calls`, one per verifier, renewed every `shared_stream_max_age_s`): a
verifier then sends each engine step's outputs as one message, not one per request; each request keeps the
deadline, the retry and the abort on leaving early that a Generate call of its own has. A request that a draining
verifier refused is retried on another call, as one refused by a connection that closed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from services.common import protos
from services.common.tls import channel_credentials, open_channel
from services.gateway.shared_stream import SharedStream, status_error, update_error
from services.gateway.shared_stream_pool import SharedStreamPool
from services.gateway.verifier_target import parse_verifier_target

pb, pb_grpc = protos.load("verifier")
logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]  # keepalive: open_channel's policy
# How a dropped connection reads when grpc does not report it as UNAVAILABLE (e.g. a GOAWAY mid-setup).
_CONNECTION_LOST = ("goaway", "socket closed", "connection reset", "too_many_pings", "too many pings")


def connection_lost(error: grpc.RpcError) -> bool:
    """Whether a call failed because the connection failed, not because the verifier refused it."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = (error.details() if callable(getattr(error, "details", None)) else "") or ""
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and any(
        marker in details.lower() for marker in _CONNECTION_LOST)


def _retry_of(request: Any) -> Any:
    """The same request under its own id: if the first attempt did reach the verifier, its id stays taken
    until the verifier notices the call is gone, and reusing it would be refused as ALREADY_EXISTS."""
    retry = type(request)()
    retry.CopyFrom(request)
    retry.request_id = f"{request.request_id}-retry" if request.request_id else ""
    return retry


class VerifierClient:
    def __init__(self, address: str, *, info_timeout_s: float = 5.0, request_timeout_s: float = 600.0,
                 root_cert: Path | None = None, shared_stream: bool = False, shared_stream_calls: int | None = None,
                 shared_stream_max_age_s: float = 60.0) -> None:
        """`shared_stream`: requests share GenerateMany calls (shared_stream.py) instead of a Generate call each:
        `shared_stream_calls` of them (None: one per address of a fixed list, else one), each taking new requests
        for `shared_stream_max_age_s` (shared_stream_pool.py)."""
        self.address = address  # as given (shown by /health); the channel's target is derived from it
        self._target = parse_verifier_target(address)
        self._info_timeout_s = info_timeout_s
        self._request_timeout_s = request_timeout_s
        self._credentials = channel_credentials(root_cert)
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._retiring: dict[grpc.aio.Channel, asyncio.Task] = {}  # old channels, closing once their calls end
        self._shares_stream = shared_stream
        self._generate_many: bool | None = None  # InfoResponse.generate_many, once asked (_serves_generate_many)
        self._pool = SharedStreamPool(shared_stream_calls or self._target.num_addresses, shared_stream_max_age_s)

    def _ensure(self) -> Any:
        if self._stub is None:
            options = [*_CHANNEL_OPTIONS, *self._target.channel_options()]
            self._channel = open_channel(self._target.target, self._credentials, options)
            self._stub = pb_grpc.VerifierStub(self._channel)
        return self._stub

    def _reopen(self, failed: Any) -> None:
        """Replace the channel `failed` came from (unless a concurrent failure did already). The old one closes
        in the background with a grace as long as a request may run, so calls still streaming on it (other
        requests, which may be fine) are not cut short by one request's failure."""
        if self._stub is not failed or self._channel is None:
            return
        old, self._channel, self._stub = self._channel, None, None
        task = asyncio.create_task(old.close(grace=self._request_timeout_s))
        self._retiring[old] = task
        task.add_done_callback(lambda _: self._retiring.pop(old, None))

    async def info(self, timeout_s: float | None = None) -> Any:
        return await self._ensure().Info(pb.InfoRequest(), timeout=timeout_s or self._info_timeout_s)

    async def _serves_generate_many(self) -> bool:
        """Whether the verifier says it serves GenerateMany (InfoResponse.generate_many), asked once. Trying the call
        and falling back on UNIMPLEMENTED was not enough: under load the refusal reached the client as an INTERNAL
        error now and then (the server reset the stream while the request was being written), a 500 for that
        request. Where Info itself fails, the call is tried, as before."""
        if self._generate_many is None:
            try:
                self._generate_many = (await self.info()).generate_many
            except grpc.RpcError:
                return True
        return self._generate_many

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        """GenerateResponse messages of one request; closing the iterator early cancels the call. Retried once,
        on a fresh channel, when the connection failed before the first message (see the module docstring)."""
        if self._shares_stream and not await self._serves_generate_many():
            logger.warning("the verifier at %s has no GenerateMany; a Generate call per request instead", self.address)
            self._shares_stream = False
        if self._shares_stream:
            try:
                async for response in self._generate_shared(request):
                    yield response
                return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                # a verifier from before GenerateMany (nothing was received): a Generate call each from now on
                logger.warning("the verifier at %s has no GenerateMany; a Generate call per request instead",
                               self.address)
                self._shares_stream = False
        for attempt in (0, 1):
            stub = self._ensure()
            sent = _retry_of(request) if attempt else request
            call = stub.Generate(sent, timeout=self._request_timeout_s)
            received = False
            try:
                async for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as error:
                if received or attempt or not connection_lost(error):
                    raise
                self._reopen(stub)
            finally:
                if not call.done():
                    call.cancel()

    async def _generate_shared(self, request: Any) -> AsyncIterator[Any]:
        """generate() over the shared GenerateMany call: the same messages, errors, deadline and retry."""
        if not request.request_id:
            request = _retry_of(request)
            request.request_id = f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._request_timeout_s
        for attempt in (0, 1):
            stream = self._shared_stream()
            sent = _retry_of(request) if attempt else request
            received = finished = False
            expiry: asyncio.TimerHandle | None = None
            try:
                updates = await stream.start(sent)
                # The deadline is one timer a request that queues DEADLINE_EXCEEDED behind the updates already in,
                # not a timeout around each wait: that was a tenth of the gateway's CPU a token at 64 requests and
                # a fifth of its loop's at one. (A get that need not wait never timed out either way.)
                expiry = loop.call_at(deadline, lambda queue=updates: queue.put_nowait(
                    status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")))
                while not finished:
                    update = await updates.get()
                    if isinstance(update, grpc.RpcError):
                        raise update
                    if update.HasField("error"):
                        raise update_error(update.error)
                    received = True
                    finished = update.output.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                    yield update.output
                return
            except grpc.RpcError as error:
                if received or attempt or not connection_lost(error):
                    raise
                if stream.error is None:
                    self._pool.replace(stream)  # the call goes on, its verifier refused the request: it drains
                else:
                    self._reopen(stream.stub)
            finally:
                if expiry is not None:
                    expiry.cancel()
                stream.finish(sent.request_id, abort=not finished)

    def _shared_stream(self) -> SharedStream:
        """The call a request starts on (shared_stream_pool.py); the pool replaces calls that ended (on a fresh
        channel when their connection failed) or were made on a channel since replaced (those end once idle)."""
        for broken in self._pool.broken():
            if connection_lost(broken.error):
                self._reopen(broken.stub)  # the connection it was on failed: new calls go out on a fresh channel
        return self._pool.pick(self._ensure())

    async def close(self) -> None:
        await self._pool.close()
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()
        retiring, self._retiring = self._retiring, {}
        for channel in retiring:
            await channel.close()  # no grace left: the gateway is stopping
        await asyncio.gather(*retiring.values(), return_exceptions=True)
