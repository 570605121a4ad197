"""POST /invocations, the route SageMaker sends a deployed model's requests to (vLLM serves it beside /ping): the
body is a chat completion, a completion or a Responses API request, told apart by the field only it has
(`messages`, `prompt`, `input`), and answered by that route, exactly as if it had been sent there."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from services.gateway.errors import ApiError
from services.gateway.request_body import read_json

Handler = Callable[[Request], Awaitable[Response]]
KIND_FIELDS = ("messages", "prompt", "input")  # the field only each kind of body has


def create_router(require_api_key: Any, handlers: dict[str, Handler]) -> APIRouter:
    """handlers: by the field that tells its kind of body apart (KIND_FIELDS), the handler of that kind's route."""
    router = APIRouter()

    @router.post("/invocations", dependencies=[Depends(require_api_key)])
    async def invocations(request: Request) -> Response:
        """Answered by /v1/chat/completions (a body with `messages`), /v1/completions (`prompt`) or /v1/responses
        (`input`)."""
        data = await read_json(request, request.app.state.gateway.settings.max_request_body_bytes)
        given = [field for field in KIND_FIELDS if isinstance(data, dict) and field in data]
        if len(given) != 1:
            raise ApiError(400, "an /invocations body is a chat completion request (with messages), a completion "
                                "request (with prompt) or a Responses API request (with input), exactly one of them",
                           code="invalid_value")
        return await handlers[given[0]](request)

    return router
