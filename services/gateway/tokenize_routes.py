"""vLLM's `/tokenize`, `/detokenize` and `/version`, which clients of vLLM's OpenAI server call to count and inspect
tokens (prompt budgeting, evaluation harnesses). Shapes as vLLM's: a prompt or chat messages in, the token ids, their
count and the model's max_model_len out; ids in, text out. Tokens come from the same code the generation routes
use (services/gateway/tokenizer.py), so a count here is the count a request would have."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool

from services.gateway import schemas as s
from services.gateway.errors import ApiError
from services.gateway.openapi import error_responses, request_body
from services.gateway.request_body import parse_body, read_json
from services.gateway.chat_prompt import chat_prompt_ids
from services.gateway.tokenizer import encode_prompt, token_text


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # optional, as in vLLM; when given it must name the served model
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[s.ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes the special tokens the model wants
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return s.check_template_kwargs(value)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(s.RefusesBooleansForNumbers):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[s.TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# Hand-parsed request bodies, for the OpenAPI document (openapi.install_openapi)
REQUEST_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)


def package_version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def create_router(require_api_key: Any) -> APIRouter:
    """The routes, behind the same API key as /v1 (they reveal the model's tokenizer, as /v1/models does)."""
    router = APIRouter()
    guarded = [Depends(require_api_key)]

    @router.post("/tokenize", dependencies=guarded,
                 openapi_extra=request_body(TokenizeCompletionRequest, TokenizeChatRequest),
                 responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 404, 413, 500, 503)})
    async def tokenize(request: Request) -> JSONResponse:
        state = request.app.state.gateway
        body = await read_json(request, state.settings.max_request_body_bytes)
        chat = isinstance(body, dict) and "messages" in body
        req = parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        await state.check_model(req.model)
        tokenizer = await state.get_tokenizer()
        if chat:
            ids = await chat_prompt_ids(tokenizer, req)
        else:
            ids = await run_in_threadpool(encode_prompt, tokenizer, req.prompt, req.add_special_tokens)
        info = await state.model_info()
        strs = [token_text(tokenizer, t) for t in ids] if req.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=info.max_model_len or None, tokens=ids,
                                             token_strs=strs).model_dump())

    @router.post("/detokenize", dependencies=guarded, openapi_extra=request_body(DetokenizeRequest),
                 responses={200: {"model": DetokenizeResponse}, **error_responses(400, 401, 404, 413, 500, 503)})
    async def detokenize(request: Request) -> JSONResponse:
        state = request.app.state.gateway
        req = parse_body(DetokenizeRequest, await read_json(request, state.settings.max_request_body_bytes))
        await state.check_model(req.model)
        tokenizer = await state.get_tokenizer()
        vocab = len(tokenizer)
        if any(t >= vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        text = await run_in_threadpool(tokenizer.decode, req.tokens)  # special tokens as text, as vLLM returns them
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @router.get("/version", responses={200: {"model": VersionResponse}})
    async def get_version() -> JSONResponse:
        return JSONResponse(VersionResponse(version=package_version()).model_dump())

    return router

