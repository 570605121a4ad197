"""OpenAI-shaped errors, `{"error": {"message", "type", "param", "code"}}`, and the one place where gRPC status
codes and validation failures become HTTP statuses. SDKs read `error.message`; a FastAPI-style `{"detail": ...}`
or a 422 would surface to users as an opaque failure."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.disconnect import ClientDisconnected
from services.gateway.schemas import ErrorDetail, ErrorResponse

_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.ALREADY_EXISTS: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.CANCELLED: HTTPStatus.SERVICE_UNAVAILABLE,
}

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


RETRY_AFTER_S = 1  # what a 503 for a full queue or a verifier that is (re)starting asks clients to wait

logger = logging.getLogger("specserve.gateway")


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message may quote what the client sent, and a string
    that is not valid Unicode (a lone surrogate) must still render instead of turning the error into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ApiError(Exception):
    """An error the client should see as-is."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_BY_STATUS.get(self.status, "server_error" if self.status >= 500 else
                                                 "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """The documented error shape (schemas.ErrorResponse, which /openapi.json publishes)."""
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def internal_error() -> ApiError:
    """What the client sees of a bug: no internals (the traceback is in the gateway's log)."""
    return ApiError(500, "The server had an error while processing your request; it has been logged.",
                    code="internal_error")


def from_grpc(error: grpc.RpcError) -> ApiError:
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    status = _GRPC_TO_HTTP.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    suffix = f" ({details})" if details else ""  # the verifier states facts; the advice is the gateway's
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(status, f"The server is overloaded{suffix}; retry in {RETRY_AFTER_S} s.",
                        code=code.name.lower(), headers=retry)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(status, f"The verifier is unavailable{suffix}; retry in {RETRY_AFTER_S} s.",
                        code=code.name.lower(), headers=retry)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(status, f"The verifier did not answer in time{suffix}.", code=code.name.lower())
    return ApiError(status, details or code.name, code=code.name.lower())


def from_validation(error: ValidationError | RequestValidationError) -> ApiError:
    """First problem only, named by its field path: what a person fixing the request needs."""
    problems = error.errors()
    if not problems:
        return ApiError(400, "invalid request")
    first = problems[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Unions report the branch tried (e.g. `prompt.str`); the field path is what the caller wrote.
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "value_error":  # our validators' own words, without pydantic's "Value error, "
        message = message.removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    extra = len(problems) - 1
    if extra > 0:
        message += f" (and {extra} more problem{'s' if extra > 1 else ''})"
    return ApiError(400, message, param=loc[0] if loc else None, code="invalid_value")


CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the response"


def unknown_route_message(request: Request, app: FastAPI) -> str:
    """What a client that called a route this server does not have (embeddings, a stored response, a typo) reads:
    the API routes it does have, so that an SDK's "404 Not Found" says where to go instead."""
    routes = sorted(path for path in app.openapi()["paths"] if path.startswith("/v1/"))  # built once, then kept
    return f"{request.method} {request.url.path} is not a route of this server; its API routes: {', '.join(routes)}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # exc.headers carry what the status needs: a 405's Allow, a 401's WWW-Authenticate
        message = str(exc.detail)
        if exc.status_code == 404:  # the router's: no route at this path (a route's own 404 is an ApiError)
            message = unknown_route_message(request, app)
        return ApiError(exc.status_code, message, headers=exc.headers).response()

    @app.exception_handler(grpc.RpcError)
    async def _grpc(_: Request, exc: grpc.RpcError) -> JSONResponse:
        return from_grpc(exc).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the metrics count it
