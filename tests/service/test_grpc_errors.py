"""The error-mapping interceptor on real servers: a servicer's exception becomes the status its service names
(ValueError -> INVALID_ARGUMENT by default, anything unexpected -> INTERNAL with a one-line reason), for
streaming and unary methods alike; deliberate aborts keep their own status."""

from __future__ import annotations

import grpc
import pytest

from services.common.drafter_wire import drafter_pb2, drafter_pb2_grpc
from services.common.grpc_server import start_grpc_server
from services.drafter.server import SERVICE_NAME, serve


class RaisingProposer:
    method = "raising"

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def propose(self, inputs):
        raise self.error

    def release(self, seq_id) -> None:
        pass


def step() -> drafter_pb2.DraftRequest:
    update = drafter_pb2.SequenceUpdate(seq_id="a", base_length=0, new_token_ids=[1, 2, 1], num_speculative_tokens=2)
    return drafter_pb2.DraftRequest(step_id=1, updates=[update])


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (ValueError("K must be positive"), grpc.StatusCode.INVALID_ARGUMENT, "K must be positive"),
        (RuntimeError("index exploded"), grpc.StatusCode.INTERNAL, "RuntimeError: index exploded"),
    ],
)
async def test_a_streaming_servicer_error_becomes_its_status(error, code, message):
    server, port = await serve(RaisingProposer(error), "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = drafter_pb2_grpc.DrafterStub(channel).Draft(timeout=5)
            await call.write(step())
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call.read()
        assert raised.value.code() == code and message in raised.value.details()
    finally:
        await server.server.stop(0)


class BrokenInfo(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    async def Info(self, request, context):
        if self.error is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not ready")
        raise self.error


@pytest.mark.parametrize(
    ("error", "status_for", "code"),
    [
        (KeyError("x"), None, grpc.StatusCode.INTERNAL),
        (KeyError("x"), lambda e: grpc.StatusCode.NOT_FOUND if isinstance(e, KeyError) else None,
         grpc.StatusCode.NOT_FOUND),
        (None, None, grpc.StatusCode.FAILED_PRECONDITION),  # a deliberate abort passes through
    ],
)
async def test_a_unary_servicer_error_becomes_the_status_its_service_names(error, status_for, code):
    servicer = BrokenInfo(error)
    extra = {"status_for": status_for} if status_for else {}
    server = await start_grpc_server(
        lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), [SERVICE_NAME], **extra
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(), timeout=5)
        assert raised.value.code() == code
    finally:
        await server.server.stop(0)
