"""The Verifier gRPC servicer: protobuf in, engine call, protobuf out (wire.py), and the one place where engine
errors become gRPC status codes. Whatever ends a Generate call early (client cancel, deadline, shutdown) aborts
the request, so its KV slot is free at the next engine step."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from services.verifier.engine import Engine, EngineOverloadedError
from services.verifier.wire import (
    DefaultSpeculation,
    DrafterReport,
    ModelFacts,
    info_to_proto,
    output_to_proto,
    request_from_proto,
    verifier_pb2_grpc,
)

logger = logging.getLogger(__name__)


def status_for(error: Exception) -> grpc.StatusCode:
    """The proto's error contract: overloaded -> RESOURCE_EXHAUSTED, id reuse -> ALREADY_EXISTS, any other
    invalid request -> INVALID_ARGUMENT."""
    if isinstance(error, EngineOverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, ValueError):
        return grpc.StatusCode.ALREADY_EXISTS if "already in use" in str(error) else grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


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
        try:
            generation = request_from_proto(request, request_id, self.default)
            stream = self.engine.add_request(generation)
        except (ValueError, EngineOverloadedError) as error:
            await context.abort(status_for(error), str(error))
        method = generation.speculation.method if generation.speculation.enabled else ""
        try:
            async for output in stream:
                yield output_to_proto(output, method)
        except Exception as error:  # an engine step failed: the request cannot continue
            logger.exception("request %s failed", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"the engine failed on this request: {error}")
        finally:
            stream.abort()  # no-op when it finished; frees the slot when the client went away

    async def Info(self, request, context: grpc.aio.ServicerContext):
        return info_to_proto(self.facts, self.drafters(), self.engine.num_running, self.engine.num_waiting, self.default)
