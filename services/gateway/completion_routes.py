"""POST /v1/completions: prompts (text or token ids) in, text choices out, through the one request pipeline."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from services.gateway import schemas as s
from services.gateway.disconnect import unless_disconnected
from services.gateway.openapi import generation_docs
from services.gateway.pipeline import Choices, admit, generate
from services.gateway.responses import PromptReturn
from services.gateway.sampling import truncate_prompt
from services.gateway.tokenizer import decode_prompt, encode_prompt


def create_router(require_api_key: Any) -> APIRouter:
    router = APIRouter()
    router.post("/v1/completions", dependencies=[Depends(require_api_key)],
                **generation_docs(s.CompletionRequest, s.CompletionResponse, s.CompletionChunk))(completions)
    return router


async def completions(request: Request) -> Response:
    """The route's handler (also what /invocations hands a body with `prompt` to)."""
    admitted = await admit(request, s.CompletionRequest)
    state, req, tokenizer = admitted.state, admitted.req, admitted.tokenizer
    encoded = [await run_in_threadpool(encode_prompt, tokenizer, p, req.add_special_tokens) for p in req.prompts()]
    limit = (await state.model_info()).max_model_len
    prompts = [truncate_prompt(ids, req.truncate_prompt_tokens, limit) for ids in encoded]
    # echo returns the prompt as sent (as kept, when truncated); a token-id prompt decoded with its special
    # tokens, as vLLM echoes it and as the echoed logprobs list its tokens (their text_offset index this text)
    echo = [(p if isinstance(p, str) and len(ids) == len(whole) else decode_prompt(tokenizer, ids))
            if req.echo else "" for p, whole, ids in zip(req.prompts(), encoded, prompts, strict=True)]
    returned = PromptReturn(echo=req.echo, echo_logprobs=req.logprobs if req.echo else None,
                            prompt_logprobs=req.prompt_logprobs)
    plan = Choices(prompts, echo, req.max_tokens, req.logprobs, returned)
    return await unless_disconnected(request, generate(state, "completion", req, admitted.served, plan))
