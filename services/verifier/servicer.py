"""The Verifier gRPC servicer: protobuf in, engine call, protobuf out (wire.py). Engine errors become gRPC status
codes in the server's interceptor, by `status_for` below. Whatever ends a Generate call early (client cancel,
deadline, shutdown, an engine failure) aborts the request, so its KV slot is free at the next engine step."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from services.common.grpc_errors import default_status
from services.verifier.engine import Engine, EngineOverloadedError, RequestIdInUseError
from services.verifier.wire import (
    DefaultSpeculation,
    DrafterReport,
    ModelFacts,
    info_to_proto,
    output_to_proto,
    request_from_proto,
    verifier_pb2_grpc,
)


def status_for(error: Exception) -> grpc.StatusCode | None:
    """The proto's error contract: overloaded -> RESOURCE_EXHAUSTED, id reuse -> ALREADY_EXISTS, any other
    invalid request -> INVALID_ARGUMENT; anything else is unexpected (INTERNAL, logged by the interceptor)."""
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

    async def Info(self, request, context: grpc.aio.ServicerContext):
        return info_to_proto(self.facts, self.drafters(), self.engine.num_running, self.engine.num_waiting, self.default)
