"""A chat request's prompt ids: its messages (and tools) rendered through the model's chat template and tokenized.
One function for /v1/chat/completions and /tokenize, so that the count /tokenize gives is the count a chat request
with the same fields would have."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from services.gateway.errors import ApiError
from services.gateway.tokenizer import encode_chat
from services.gateway.tools.schemas import ToolDef
from services.gateway.tools.template import render_inputs, template_knows_tools


async def chat_prompt_ids(tokenizer: Any, req: Any, tools: Sequence[ToolDef] = ()) -> list[int]:
    """`req`: a chat request (messages, add_generation_prompt, continue_final_message, add_special_tokens,
    chat_template_kwargs). A conversation the template refuses is a 400 on `messages`."""
    messages, tool_dicts = render_inputs([m.template_dict() for m in req.messages], list(tools),
                                         template_knows_tools(tokenizer))
    try:
        return await run_in_threadpool(encode_chat, tokenizer, messages, tools=tool_dicts,
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       add_special_tokens=req.add_special_tokens,
                                       template_kwargs=req.chat_template_kwargs)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
