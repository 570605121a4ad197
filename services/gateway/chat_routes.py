"""POST /v1/chat/completions: messages rendered with the model's chat template, assistant messages out (tool
calls read out of the text when the request offers tools), through the one request pipeline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from services.gateway import schemas as s
from services.gateway.chat_prompt import chat_prompt_ids
from services.gateway.disconnect import unless_disconnected
from services.gateway.errors import ApiError
from services.gateway.openapi import generation_docs
from services.gateway.pipeline import Choices, admit, generate
from services.gateway.responses import PromptReturn
from services.gateway.sampling import truncate_prompt
from services.gateway.state import GatewayState
from services.gateway.tokenizer import added_token_id
from services.gateway.tools.grammar import forced_call_grammar
from services.gateway.tools.output import ToolOutput
from services.gateway.tools.parsers import ToolCallFormat
from services.gateway.verifier_client import pb


def create_router(require_api_key: Any, call_format: ToolCallFormat) -> APIRouter:
    """call_format: how this model writes tool calls (--tool-call-parser)."""
    router = APIRouter()
    router.post("/v1/chat/completions", dependencies=[Depends(require_api_key)],
                **generation_docs(s.ChatCompletionRequest, s.ChatCompletionResponse,
                                  s.ChatCompletionChunk))(chat_handler(call_format))
    return router


def chat_handler(call_format: ToolCallFormat) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler (also what /invocations hands a body with `messages` to)."""

    async def chat_completions(request: Request) -> Response:
        admitted = await admit(request, s.ChatCompletionRequest)
        plan = await chat_choices(admitted.state, admitted.tokenizer, admitted.req, call_format)
        return await unless_disconnected(request, generate(admitted.state, "chat", admitted.req, admitted.served,
                                                           plan))

    return chat_completions


async def chat_choices(state: GatewayState, tokenizer: Any, req: s.ChatCompletionRequest,
                       call_format: ToolCallFormat) -> Choices:
    """What the pipeline runs for a chat request (one prompt: the rendered conversation); the Responses API's
    route runs the same for the chat request its body means."""
    tools = req.offered_tools()
    ids = await chat_prompt_ids(tokenizer, req, tools)
    ids = truncate_prompt(ids, req.truncate_prompt_tokens, (await state.model_info()).max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Choices([ids], [""], req.requested_max_tokens, logprobs, PromptReturn(prompt_logprobs=req.prompt_logprobs),
                   tool_output(req, tools, call_format, partial(added_token_id, tokenizer)),
                   "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")


def tool_output(req: s.ChatCompletionRequest, tools: list, call_format: ToolCallFormat,
                added_token_id: Callable[[str], int | None]) -> ToolOutput | None:
    """How this request's output is read for tool calls (None: it offers none); a forced call's grammar
    (`added_token_id`: the model's added token spelled as a text, tools/grammar.py)."""
    if not tools:
        return None
    forced = None
    if req.forces_a_call:
        if req.structured_output() is not None:
            raise ApiError(400, "tool_choice forcing a call cannot be combined with response_format, "
                                "structured_outputs or guided_* (the call's grammar is the output's)",
                           param="tool_choice")
        several = req.tool_choice == "required" and req.parallel_tool_calls is not False
        forced = pb.StructuredOutput(grammar=forced_call_grammar(tools, call_format, several=several,
                                                                 added_token_id=added_token_id))
    return ToolOutput(call_format, forced)
