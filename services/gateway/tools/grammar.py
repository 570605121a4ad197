"""tool_choice "required" or a named function, enforced: an llguidance Lark grammar (the verifier masks every
verified position with it, speculation included) whose only sentences are tool calls in the model's format, each
a JSON object {"name": <an offered tool>, "arguments": <valid against that tool's parameters>}. With
parallel_tool_calls (OpenAI's default) "required" allows several calls in a row; a named function, exactly one.

A format's tags may be tokens of their own in the model's vocabulary: Qwen2.5 adds `<tool_call>` and `</tool_call>`
(ids 151657 and 151658, not marked special) and writes them so. Written as text only, the tag matched the token in
llguidance's mask but not when the token was committed (llguidance reads an added token's bytes as its own
marker there), so every forced call on Qwen2.5 failed at its first token with a 400. Each tag that is an added
token is therefore the token or its text (`("<tool_call>" | <[151657]>)`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from services.gateway.tools.parsers import ToolCallFormat
from services.gateway.tools.schemas import ToolDef

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(tool: ToolDef) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "arguments": tool.function.parameters or ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_grammar(tools: list[ToolDef], fmt: ToolCallFormat, *, several: bool,
                        added_token_id: Callable[[str], int | None] = lambda text: None) -> str:
    """`added_token_id(text)`: the id of the vocabulary's added token spelled `text` (None: there is none)."""
    schema = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    repeat = ' ("\\n" call)*' if several else ""
    open_, close = (_lark_sequence(text, fmt.tags, added_token_id) for text in (fmt.call_open, fmt.call_close))
    return "\n".join([
        f"start: call{repeat}",
        f"call: {open_} body {close}",
        f"body: %json {json.dumps(schema)}",
    ])


def _lark_sequence(text: str, tags: tuple[str, ...], added_token_id: Callable[[str], int | None]) -> str:
    """`text` as Lark items: each of `tags` in it that is an added token as that token or its text, the rest as
    text."""
    items: list[str] = []
    rest = text
    while rest:
        found = [(rest.find(tag), tag) for tag in tags if tag in rest]
        if not found:
            items.append(json.dumps(rest))
            break
        start, tag = min(found)
        if start:
            items.append(json.dumps(rest[:start]))
        token = added_token_id(tag)
        items.append(json.dumps(tag) if token is None else f"({json.dumps(tag)} | <[{token}]>)")
        rest = rest[start + len(tag):]
    return " ".join(items)
