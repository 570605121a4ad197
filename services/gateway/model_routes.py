"""GET /v1/models and /v1/models/{id}: the one served model, with vLLM's fields (root, max_model_len)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from services.gateway import schemas as s
from services.gateway.openapi import error_responses
from services.gateway.state import GatewayState


async def model_card(state: GatewayState, name: str | None = None) -> s.ModelCard:
    """The served model's card; a 404 when `name` names another."""
    info = await state.model_info()
    served = await state.check_model(name)
    return s.ModelCard(id=served, created=int(time.time()), root=info.model_id,
                       max_model_len=info.max_model_len or None)


def create_router(require_api_key: Any) -> APIRouter:
    router = APIRouter()
    guarded = [Depends(require_api_key)]

    @router.get("/v1/models", dependencies=guarded,
                responses={200: {"model": s.ModelList}, **error_responses(401, 500, 503)})
    async def models(request: Request) -> JSONResponse:
        card = await model_card(request.app.state.gateway)
        return JSONResponse(s.ModelList(data=[card]).model_dump())

    @router.get("/v1/models/{model_id:path}", dependencies=guarded,
                responses={200: {"model": s.ModelCard}, **error_responses(401, 404, 500, 503)})
    async def model(request: Request, model_id: str) -> JSONResponse:
        return JSONResponse((await model_card(request.app.state.gateway, model_id)).model_dump())

    return router
