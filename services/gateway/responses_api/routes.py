"""POST /v1/responses: the body read as the chat request it means (request.py), run through the chat pipeline, the
output returned as a response object or a stream of Responses events (builder.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from services.gateway import schemas as s
from services.gateway.chat_routes import chat_choices
from services.gateway.disconnect import unless_disconnected
from services.gateway.openapi import generation_docs
from services.gateway.pipeline import admit, generate
from services.gateway.request_body import parse_body
from services.gateway.responses_api.builder import ResponsesApiResponses
from services.gateway.responses_api.request import ResponsesRequest
from services.gateway.responses_api.shapes import ResponseObject, StreamEvent
from services.gateway.tools.parsers import ToolCallFormat


def create_router(require_api_key: Any, call_format: ToolCallFormat) -> APIRouter:
    router = APIRouter()
    router.post("/v1/responses", dependencies=[Depends(require_api_key)],
                **generation_docs(ResponsesRequest, ResponseObject, StreamEvent))(responses_handler(call_format))
    return router


def responses_handler(call_format: ToolCallFormat) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler (also what /invocations hands a body with `input` to)."""

    async def responses(request: Request) -> Response:
        admitted = await admit(request, ResponsesRequest)
        body: ResponsesRequest = admitted.req
        chat = parse_body(s.ChatCompletionRequest, body.chat_body())
        plan = replace(await chat_choices(admitted.state, admitted.tokenizer, chat, call_format),
                       max_field="max_output_tokens")
        respond = partial(ResponsesApiResponses, request=body, tools=plan.tools)
        return await unless_disconnected(request, generate(admitted.state, "response", chat, admitted.served, plan,
                                                           respond))

    return responses
