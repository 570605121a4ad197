"""The Hermes tool-call format, which Qwen2.5 (and Hermes, and many fine-tunes) emit:

    text before<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse` splits a whole output into content and calls; `HermesStream` does the same on streamed text: content is
passed on at once, except text that may be the start of `<tool_call>` (held until it is known), and each call is
emitted whole when its closing tag arrives (OpenAI's delta format allows one delta per call). A call whose body
is not a JSON object with a name is not a call: it stays content, as vLLM does, never an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from services.gateway.tools.schemas import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str) -> ToolCall | None:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), function=FunctionCall(name=parsed["name"],
                                                            arguments=json.dumps(arguments, ensure_ascii=False)))


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """(content outside the calls, the calls in order)."""
    stream = HermesStream()
    content = "".join(d.content or "" for d in stream.feed(text) + stream.finish())
    return content, stream.calls


@dataclass
class StreamDelta:
    content: str | None = None
    tool_call: ToolCallDelta | None = None


@dataclass
class HermesStream:
    calls: list[ToolCall] = field(default_factory=list)
    _pending: str = ""  # text not yet passed on: a possible tag start, or an open call's body
    _in_call: bool = False

    def feed(self, text: str) -> list[StreamDelta]:
        self._pending += text
        out: list[StreamDelta] = []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._in_call = False
                out.append(self._finish_call(body))
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                if start:
                    out.append(StreamDelta(content=self._pending[:start]))
                self._pending = self._pending[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_tag_length(self._pending)
            cut = len(self._pending) - keep
            if cut:
                out.append(StreamDelta(content=self._pending[:cut]))
                self._pending = self._pending[cut:]
            return out

    def finish(self) -> list[StreamDelta]:
        """The end of the output: held text is content (an unclosed call too: it was not a call)."""
        held = (OPEN + self._pending) if self._in_call else self._pending
        self._pending, self._in_call = "", False
        return [StreamDelta(content=held)] if held else []

    def _finish_call(self, body: str) -> StreamDelta:
        call = _call(body.strip())
        if call is None:
            return StreamDelta(content=OPEN + body + CLOSE)
        index = len(self.calls)
        self.calls.append(call)
        return StreamDelta(tool_call=ToolCallDelta(index=index, id=call.id, type="function", function=FunctionCallDelta(
            name=call.function.name, arguments=call.function.arguments)))


def _partial_tag_length(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN (it may become the tag)."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
