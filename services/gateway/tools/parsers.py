"""Tool-call output formats by name (the gateway's --tool-call-parser, vLLM's flag): one module per format, each
with `parse(text) -> (content, calls)` and a streaming class. A new format is its module plus one line here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.tools import hermes


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    parse: Any  # (text) -> (content, list[ToolCall])
    stream: Any  # () -> an object with feed(text) and finish(), both returning StreamDeltas
    call_open: str  # what a call starts with and ends with, for the grammar that forces calls
    call_close: str
    tags: tuple[str, ...] = ()  # the texts in those that a model's vocabulary may hold as tokens of their own


FORMATS = {
    "hermes": ToolCallFormat("hermes", hermes.parse, hermes.HermesStream, hermes.OPEN + "\n", "\n" + hermes.CLOSE,
                             (hermes.OPEN, hermes.CLOSE)),
}


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(sorted(FORMATS))}") from None
