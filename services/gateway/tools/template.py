"""The conversation as the chat template wants it, tools included.

A template that knows tools (Qwen2.5's: it mentions `tools`) gets them as transformers passes them
(`apply_chat_template(messages, tools=...)`), assistant tool calls with their arguments as objects, and tool
results as `tool` messages. A template that does not (SmolLM2's) would drop them silently, so then the tools
reach the model the way the Hermes format writes them: a system message listing them and saying how to call,
the assistant's calls written out in its text, and each result as a user message in <tool_response> tags.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tools.schemas import ToolDef

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _written_call(call: dict[str, Any]) -> str:
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def render_inputs(messages: list[dict[str, Any]], tools: list[ToolDef],
                  knows_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template. `messages` hold role, content (text, "" for none) and, where
    sent, tool_calls (arguments already parsed into objects) or tool_call_id."""
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if knows_tools or not uses_tools:
        return messages, tool_dicts or None
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = "\n".join(_written_call(c) for c in message["tool_calls"])
            rendered.append({"role": "assistant", "content": (message["content"] + "\n" + calls).lstrip("\n")})
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    if tool_dicts:
        listing = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + listing}
        else:
            rendered.insert(0, {"role": "system", "content": listing})
    return rendered, None
