"""tool_choice "required" or a named function, enforced: an llguidance Lark grammar (the verifier masks every
verified position with it, speculation included) whose only sentences are tool calls in the model's format, each
a JSON object {"name": <an offered tool>, "arguments": <valid against that tool's parameters>}. With
parallel_tool_calls (OpenAI's default) "required" allows several calls in a row; a named function, exactly one."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tools.parsers import ToolCallFormat
from services.gateway.tools.schemas import ToolDef

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(tool: ToolDef) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "arguments": tool.function.parameters or ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_grammar(tools: list[ToolDef], fmt: ToolCallFormat, *, several: bool) -> str:
    schema = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    repeat = ' ("\\n" call)*' if several else ""
    return "\n".join([
        f"start: call{repeat}",
        f"call: {json.dumps(fmt.call_open)} body {json.dumps(fmt.call_close)}",
        f"body: %json {json.dumps(schema)}",
    ])
