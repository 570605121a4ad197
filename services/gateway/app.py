"""The FastAPI application: the routes' modules put together, health, metrics, the API key.

Each endpoint has its own route module (completion_routes, chat_routes, model_routes, tokenize_routes); the two
generation routes share one request pipeline (pipeline.py) and differ only in their response builders
(response_builders.py). Bodies are read and parsed by hand (size limit, strict UTF-8, JSON, then pydantic) so every
failure has the OpenAI error shape and a 400/413 status rather than FastAPI's 422 (request_body.py; openapi.py
documents the bodies all the same). A bug anywhere in a route is still an OpenAI-shaped 500, logged once and
counted.
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway import chat_routes, completion_routes, invocations_route, model_routes, tokenize_routes
from services.gateway import schemas as s
from services.gateway.errors import ApiError, from_grpc, install_error_handlers
from services.gateway.metrics import GatewayMetrics
from services.gateway.openapi import install_openapi
from services.gateway.request_counter import RequestCounter
from services.gateway.responses_api import routes as responses_api_routes
from services.gateway.responses_api.request import ResponsesRequest
from services.gateway.responses_api.shapes import RESPONSES_STREAM_EVENTS
from services.gateway.settings import GatewaySettings
from services.gateway.state import GatewayState
from services.gateway.tools.parsers import tool_call_format
from services.gateway.verifier_client import VerifierClient, pb

_DRAFTER_STATES = {pb.DRAFTER_STATE_SERVING: "serving", pb.DRAFTER_STATE_DISCONNECTED: "disconnected",
                   pb.DRAFTER_STATE_REFUSED: "refused", pb.DRAFTER_STATE_DEGRADED: "degraded",
                   pb.DRAFTER_STATE_UNSPECIFIED: "unknown"}
_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ping", "/metrics", "/tokenize",
           "/detokenize", "/version", "/v1/responses", "/invocations"}
MODEL_ROUTE = "/v1/models/{model}"  # one metrics label for every model id asked for



def create_app(settings: GatewaySettings, tokenizer: Any = None, client: VerifierClient | None = None) -> FastAPI:
    client = client or VerifierClient(settings.verifier, info_timeout_s=settings.info_timeout_s,
                                      request_timeout_s=settings.request_timeout_s,
                                      root_cert=settings.grpc_root_cert,
                                      shared_stream=settings.verifier_shared_stream,
                                      shared_stream_calls=settings.verifier_shared_stream_calls,
                                      shared_stream_max_age_s=settings.verifier_shared_stream_max_age_s)
    state = GatewayState(settings=settings, client=client, metrics=GatewayMetrics(), tokenizer=tokenizer)
    call_format = tool_call_format(settings.tool_call_parser)  # an unknown name fails at start-up

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        preparing = asyncio.create_task(state.prepare(), name="specserve-gateway-prepare")
        yield
        preparing.cancel()
        await client.close()

    app = FastAPI(title="specserve gateway", lifespan=lifespan)
    app.state.gateway = state
    install_error_handlers(app)
    install_openapi(app, [s.CompletionRequest, s.ChatCompletionRequest, ResponsesRequest,
                          *tokenize_routes.REQUEST_MODELS],
                    [s.CompletionChunk, s.ChatCompletionChunk, *RESPONSES_STREAM_EVENTS])

    def count(path: str, status: int) -> None:
        path = path if path in _ROUTES else MODEL_ROUTE if path.startswith("/v1/models/") else "other"
        state.metrics.requests.labels(path, str(status)).inc()

    app.add_middleware(RequestCounter, count=count)
    if settings.allowed_origins:  # outermost: a preflight is answered before the counter and any route's API key
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers,
                           allow_credentials=settings.allow_credentials)

    async def require_api_key(request: Request) -> None:
        key = settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.get_secret_value().encode()):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    app.include_router(tokenize_routes.create_router(require_api_key))

    @app.get("/health", responses={200: {"model": s.Health}, 503: {"model": s.Health}})
    async def health() -> JSONResponse:
        """Open even with an API key (load balancers probe it), so then it tells the status only: the
        verifier's and drafters' addresses and error details are for operators, on the metrics and logs."""
        report = await _health(client, state)
        body = s.Health(status=report.status) if settings.api_key is not None else report
        return JSONResponse(body.public(), status_code=200 if report.status in ("ok", "degraded") else 503)

    # vLLM's /ping (GET or POST, the health check SageMaker endpoints send): the same answer as /health
    for method in ("GET", "POST"):  # a route a method: one route of both gave /openapi.json one operationId twice
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}",
                          responses={200: {"model": s.Health}, 503: {"model": s.Health}})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(model_routes.create_router(require_api_key))
    app.include_router(completion_routes.create_router(require_api_key))
    app.include_router(chat_routes.create_router(require_api_key, call_format))
    app.include_router(responses_api_routes.create_router(require_api_key, call_format))
    app.include_router(invocations_route.create_router(require_api_key, {  # SageMaker's route, beside /ping
        "messages": chat_routes.chat_handler(call_format), "prompt": completion_routes.completions,
        "input": responses_api_routes.responses_handler(call_format)}))

    return app


async def _health(client: VerifierClient, state: GatewayState) -> s.Health:
    """Ready (200: ok or degraded) only with the tokenizer loaded and the verifier answering."""
    if state.tokenizer_problem is not None:
        return s.Health(status="unavailable", verifier=client.address, error=state.tokenizer_problem)
    try:
        info = await client.info()
    except grpc.RpcError as exc:
        return s.Health(status="unavailable", verifier=client.address, error=from_grpc(exc).message)
    if state.tokenizer is None:
        return s.Health(status="starting", model=info.model_id, verifier=client.address,
                        error="loading the tokenizer")
    drafters = [s.DrafterHealth(name=d.name, method=d.method, address=d.address,
                                state=_DRAFTER_STATES.get(d.state, "unknown"), detail=d.detail,
                                num_fallbacks=d.num_fallbacks) for d in info.drafters]
    degraded = any(d.state != "serving" for d in drafters)
    return s.Health(status="degraded" if degraded else "ok", model=info.model_id, verifier=client.address,
                    num_running=info.num_running, num_waiting=info.num_waiting, drafters=drafters)
