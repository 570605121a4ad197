"""The one place where an exception escaping a servicer becomes a gRPC status.

Servicers stay thin: they raise what their pure functions raise (ValueError for a bad request, a service's own
errors for its own conditions) and this interceptor turns it into the proto's status contract, so the mapping
is written once per service instead of a try/except in every method. A servicer that aborts on purpose
(`context.abort`), a cancelled call and a call the stopped server ended pass through untouched. Unexpected errors
are logged with their traceback here and reach the client as INTERNAL with a one-line reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import grpc
from grpc._cython import cygrpc

logger = logging.getLogger(__name__)

# What grpc.aio raises in a servicer that reads or writes once its server has stopped (a private class; without
# it, nothing matches). Not the servicer's failure: grpc ends the call itself and logs one warning line. Mapped here
# it was logged as the method failing, with a traceback, whenever a stream outlived a stopping drafter.
SERVER_STOPPED: tuple[type[BaseException], ...] = tuple(filter(None, [getattr(cygrpc, "_ServerStoppedError", None)]))

StatusFor = Callable[[Exception], "grpc.StatusCode | None"]


def default_status(error: Exception) -> grpc.StatusCode | None:
    """ValueError (and pydantic's ValidationError, one of them): the request is invalid. Others: unknown here."""
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, status_for: StatusFor = default_status) -> None:
        self._status_for = status_for

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        )
        for kind, make in kinds:
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(
                    self._wrap(behavior, method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _wrap(self, behavior, method: str):
        if inspect.isasyncgenfunction(behavior):

            async def streaming(request, context):
                try:
                    async for response in behavior(request, context):
                        yield response
                except Exception as error:  # noqa: BLE001 - mapped, logged, and re-raised as an abort
                    await self._abort(context, method, error)

            return streaming

        async def unary(request, context):
            try:
                return await behavior(request, context)
            except Exception as error:  # noqa: BLE001
                await self._abort(context, method, error)

        return unary

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
        if isinstance(error, (grpc.aio.AbortError, *SERVER_STOPPED)):
            raise error  # the servicer aborted with a status of its own choosing, or the server has stopped
        await context.abort(*status_of(error, self._status_for, method))


def status_of(error: Exception, status_for: StatusFor, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message `error` ends a call (or one request of it, GenerateMany's) with: `status_for`'s
    code, or INTERNAL with a one-line reason for an unexpected error, which is logged with its traceback."""
    code = status_for(error)
    if code is None:
        logger.exception("%s failed", method, exc_info=error)
        return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(error).__name__}: {error}"
    return code, str(error) or type(error).__name__
