"""GET /v1/models and /v1/models/{id}: the served model under each of its served names (vLLM's
--served-model-name), with vLLM's fields (root, max_model_len)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from services.gateway import schemas as s
from services.gateway.openapi import error_responses
from services.gateway.state import GatewayState


async def model_card(state: GatewayState, name: str) -> s.ModelCard:
    """The served model's card under `name`; a 404 when `name` is not one of its served names."""
    info = await state.model_info()
    await state.check_model(name)
    return s.ModelCard(id=name, created=int(time.time()), root=info.model_id,
                       max_model_len=info.max_model_len or None)


def create_router(require_api_key: Any) -> APIRouter:
    router = APIRouter()
    guarded = [Depends(require_api_key)]

    @router.get("/v1/models", dependencies=guarded,
                responses={200: {"model": s.ModelList}, **error_responses(401, 500, 503)})
    async def models(request: Request) -> JSONResponse:
        state: GatewayState = request.app.state.gateway
        cards = [await model_card(state, name) for name in await state.served_names()]
        return JSONResponse(s.ModelList(data=cards).model_dump())

    @router.get("/v1/models/{model_id:path}", dependencies=guarded,
                responses={200: {"model": s.ModelCard}, **error_responses(401, 404, 500, 503)})
    async def model(request: Request, model_id: str) -> JSONResponse:
        return JSONResponse((await model_card(request.app.state.gateway, model_id)).model_dump())

    return router
