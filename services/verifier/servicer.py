"""The Verifier gRPC servicer: protobuf in, engine call, protobuf out (wire.py). Engine errors become gRPC status
codes in the server's interceptor, by `status_for` below (in GenerateMany, a request's error update carries the
same code). Whatever ends a Generate call early (client cancel, deadline, shutdown, an engine failure) aborts the
request, so its KV slot is free at the next engine step; a GenerateMany call ending early aborts all of its.

Draining (RunningVerifier.stop, before the server stops taking calls): a GenerateMany call starts no more requests
and refuses each with UNAVAILABLE, since its client would otherwise keep sending new requests down a call that is
about to end (a new call, a Generate call each, is steered to a SERVING verifier by the client's health check). Its
requests already running go on, as Generate calls in flight do, and the call ends (OK) once they have: an idle
call its client keeps open would otherwise last until the server's grace ran out and was cancelled."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from services.common.grpc_errors import default_status, status_of
from services.common.verifier_metadata import VERIFIER_ID_KEY
from services.verifier.engine import Engine, EngineOverloadedError, RequestIdInUseError
from services.verifier.request_mux import RequestMux
from services.verifier.wire import (
    DefaultSpeculation,
    DrafterReport,
    ModelFacts,
    info_to_proto,
    output_to_proto,
    request_from_proto,
    updates_to_proto,
    verifier_pb2_grpc,
)


class VerifierDrainingError(RuntimeError):
    """A request started on a GenerateMany call while the verifier drains: start it elsewhere."""


def status_for(error: Exception) -> grpc.StatusCode | None:
    """The proto's error contract: overloaded -> RESOURCE_EXHAUSTED, id reuse -> ALREADY_EXISTS, draining ->
    UNAVAILABLE, any other invalid request -> INVALID_ARGUMENT; anything else is unexpected (INTERNAL, logged by the
    interceptor)."""
    if isinstance(error, VerifierDrainingError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, EngineOverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, RequestIdInUseError):
        return grpc.StatusCode.ALREADY_EXISTS
    return default_status(error)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(
        self,
        engine: Engine,
        facts: ModelFacts,
        default: DefaultSpeculation,
        drafters: Callable[[], Sequence[DrafterReport]] = tuple,
    ) -> None:
        self.engine = engine
        self.facts = facts
        self.default = default
        self.drafters = drafters
        self.draining = False  # set by drain(): GenerateMany calls start no more requests
        self.instance_id = uuid.uuid4().hex  # sent on each GenerateMany call (VERIFIER_ID_KEY)
        self._calls: set[RequestMux] = set()  # the GenerateMany calls in progress

    def drain(self) -> None:
        """From now on a request started on a GenerateMany call is refused with UNAVAILABLE and each call ends once
        its running requests have (see the module docstring); they go on."""
        self.draining = True
        for mux in self._calls:
            mux.close_input()

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        generation = request_from_proto(request, request_id, self.default)
        stream = self.engine.add_request(generation)
        method = generation.speculation.method if generation.speculation.enabled else ""
        try:
            async for output in stream:
                yield output_to_proto(output, method)
        finally:
            stream.abort()  # no-op when it finished; frees the slot when the client went away or it failed

    async def GenerateMany(self, requests, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """Many requests on one stream (verifier.proto): the requests read by a task of their own, each step's
        outputs sent as one message (request_mux.py). A request refused or failed ends with an error update; the
        call ending early aborts every request still running on it."""
        await context.send_initial_metadata(((VERIFIER_ID_KEY, self.instance_id),))
        mux = RequestMux()
        self._calls.add(mux)
        if self.draining:
            mux.close_input()
        reader = asyncio.create_task(self._read_many(requests, mux), name="specserve-generate-many-reader")
        try:
            while not mux.done:
                updates = await mux.next_updates()
                if updates:
                    yield updates_to_proto(updates, self._status_of)
            if not self.draining:
                await reader  # the client's side ended cleanly, or its error ends the call
        finally:
            self._calls.discard(mux)
            reader.cancel()
            mux.abort_all()  # no-op once every request has finished; frees their slots when the client went away

    async def _read_many(self, requests, mux: RequestMux) -> None:
        try:
            async for message in requests:
                action = message.WhichOneof("action")
                if action == "start":
                    self._start(message.start, mux)
                elif action == "abort":
                    mux.abort(message.abort)
        finally:
            mux.close_input()

    def _start(self, message, mux: RequestMux) -> None:
        if self.draining:
            mux.refuse(message.request_id, VerifierDrainingError("the verifier is draining; start the request on "
                                                                 "another call"))
            return
        try:
            generation = request_from_proto(message, message.request_id, self.default)
        except Exception as error:  # noqa: BLE001 - this request is refused, the stream goes on
            mux.refuse(message.request_id, error)
            return
        method = generation.speculation.method if generation.speculation.enabled else ""
        mux.start(message.request_id, method, lambda sink: self.engine.add_request(generation, sink))

    @staticmethod
    def _status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
        """What a request's error update says: what the server's interceptor would have ended its Generate call
        with."""
        return status_of(error, status_for, "GenerateMany")

    async def Info(self, request, context: grpc.aio.ServicerContext):
        return info_to_proto(self.facts, self.drafters(), self.engine.num_running, self.engine.num_waiting, self.default)
