"""A chat choice's output read for tool calls: the whole message, or streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.tools.parsers import ToolCallFormat
from services.gateway.tools.schemas import ToolCall, ToolCallDelta


@dataclass(frozen=True)
class ToolOutput:
    format: ToolCallFormat
    forced: Any | None = None  # proto StructuredOutput forcing a call (tool_choice required / named), or None

    def message(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool_calls, finish_reason): "tool_calls" when the model stopped after calling."""
        content, calls = self.format.parse(text)
        if not calls:
            return text, None, finish_reason
        return content.strip() or None, calls, "tool_calls" if finish_reason == "stop" else finish_reason


@dataclass
class StreamedChoice:
    """One streamed choice: text in, (content, tool call deltas) out; the finish reason rewritten at the end."""

    output: ToolOutput
    parser: Any = None

    def __post_init__(self) -> None:
        self.parser = self.output.format.stream()

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[ToolCallDelta] | None]:
        deltas = self.parser.feed(text) + (self.parser.finish() if finished else [])
        content = "".join(d.content for d in deltas if d.content)
        calls = [d.tool_call for d in deltas if d.tool_call is not None]
        return content or None, calls or None

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.parser.calls else reason
