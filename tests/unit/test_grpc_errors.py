"""The error-mapping interceptor: a servicer's exception becomes the contract's status; a call that the stopped
server ended is grpc's to end, not a failure of the method."""

from __future__ import annotations

import logging

import grpc
import pytest

from services.common.grpc_errors import SERVER_STOPPED, ErrorMappingInterceptor


class RecordingContext:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError(code, details)


def streaming(error: Exception):
    async def behavior(request, context):
        yield "first"
        raise error

    return ErrorMappingInterceptor()._wrap(behavior, "/specserve.v1.Drafter/Draft")


async def drain(stream) -> list:
    return [item async for item in stream]


async def test_a_bad_request_is_invalid_argument():
    context = RecordingContext()
    with pytest.raises(grpc.aio.AbortError):
        await drain(streaming(ValueError("no such sequence"))(None, context))
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "no such sequence")


async def test_a_stopped_server_ends_the_call_without_a_failure_logged(caplog):
    """A Draft stream still open as the drafter stops reads from the stopped server: grpc raises its
    _ServerStoppedError, which was logged as "Draft failed" with a traceback and mapped to INTERNAL."""
    assert SERVER_STOPPED, "grpc.aio no longer has _ServerStoppedError: find what it raises once stopped"
    context = RecordingContext()
    with caplog.at_level(logging.DEBUG, logger="services.common.grpc_errors"), pytest.raises(SERVER_STOPPED):
        await drain(streaming(SERVER_STOPPED[0]("Server already stopped."))(None, context))
    assert context.aborted is None
    assert not caplog.records
