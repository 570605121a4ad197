"""POST /v1/responses' responses, built from the one choice's events as the chat builder builds a chat's: the whole
response object, or a stream of OpenAI's Responses events.

A stream opens with response.created and response.in_progress; text opens an assistant message item (its
output_item.added and content_part.added) and arrives as output_text.delta events; a tool call, read out of the
text as it completes (tools/output.py), closes the open message and is one function_call item (added, arguments
delta and done, done); the end closes what is open and sends response.completed, or response.incomplete when
max_output_tokens cut the output. Every item a stream sends is in the final response's output, in order.
"""

from __future__ import annotations

import uuid
from typing import Any

from services.gateway.errors import ApiError
from services.gateway.generation import ChoiceEvent
from services.gateway.response_builders import ChoiceOutput, RequestContext
from services.gateway.responses_api import shapes as r
from services.gateway.responses_api.request import ResponsesRequest
from services.gateway.schemas import SpeculativeDecoding
from services.gateway.tools.output import StreamedChoice, ToolOutput
from services.gateway.tools.schemas import ToolCall, ToolCallDelta


class ResponsesApiResponses:
    ends_with_done = False  # OpenAI's Responses streams end with response.completed, not a [DONE] line

    def __init__(self, ctx: RequestContext, request: ResponsesRequest, tools: ToolOutput | None) -> None:
        self.ctx = ctx
        self.request = request
        self.tools = tools
        self._streamed_calls = StreamedChoice(tools) if tools is not None else None
        self._sequence = 0
        self._items: list[r.OutputItem] = []  # sent so far, in order
        self._open: r.OutputMessage | None = None
        # with tools: whitespace not yet sent, which opens no message on its own (the whole response strips a
        # message's text around calls and has no message of whitespace beside them)
        self._pending_space = ""

    # ---- whole ----

    def whole(self, outputs: dict[int, ChoiceOutput]) -> r.ResponseObject:
        out = outputs[0]
        reason = self._finish_reason()
        content, calls = out.text, None
        if self.tools is not None:
            content, calls, _ = self.tools.message(out.text, reason)
        status = "incomplete" if reason == "length" else "completed"
        items: list[r.OutputItem] = []
        if content is not None or not calls:
            items.append(r.OutputMessage(id=_item_id("msg"), status=status, content=[
                r.OutputText(text=content or "", logprobs=self._logprobs(out.logprobs))]))
        items += [_function_call(call, "completed") for call in calls or ()]
        return self._response(status, items, final=True)

    # ---- stream ----

    def opening_chunks(self) -> list[r.StreamEvent]:
        return [self._event(r.ResponseEvent, "response.created", response=self._response("in_progress", [])),
                self._event(r.ResponseEvent, "response.in_progress", response=self._response("in_progress", []))]

    def chunk(self, event: ChoiceEvent, speculation: SpeculativeDecoding | None) -> list[r.StreamEvent]:
        text, calls = event.text or None, None
        if self._streamed_calls is not None:
            text, calls = self._streamed_calls.feed(event.text, event.finish_reason is not None)
            if text is not None and self._open is None:
                text, self._pending_space = self._pending_space + text, ""
                if not text.strip():
                    text, self._pending_space = None, text
        logprobs = self._logprobs(event.logprobs) or []
        events: list[r.StreamEvent] = []
        if text or logprobs:
            events += self._open_message()
            events.append(self._text_delta(text or "", logprobs))
        for call in calls or ():
            events += self._close_message("completed")
            events += self._send_call(call)
        return events

    def closing_chunks(self) -> list[r.StreamEvent]:
        reason = self._finish_reason()
        status = "incomplete" if reason == "length" else "completed"
        events = self._close_message(status)
        if not self._items:  # nothing but whitespace was written: a message of it, as the whole response has
            events += self._open_message()
            if self._pending_space:
                events.append(self._text_delta(self._pending_space, []))
            events += self._close_message(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(r.ResponseEvent, kind, response=self._response(status, self._items, final=True))]

    def error_chunks(self, error: ApiError) -> list[r.StreamEvent]:
        """A failure after the stream began, as OpenAI's server says it: an `error` event, then `response.failed`
        whose response holds what was written so far and the error (status "failed", error.code)."""
        code = ("rate_limit_exceeded" if error.status == 429 else "invalid_prompt" if error.status < 500
                else "server_error")
        failed = self._response("failed", self._items, error=r.ResponseError(code=code, message=error.message))
        return [self._event(r.ErrorEvent, "error", code=error.code or error.type, message=error.message,
                            param=error.param),
                self._event(r.ResponseEvent, "response.failed", response=failed)]

    def usage_chunk(self) -> None:
        """Never asked for (the chat request this route runs has no stream_options): usage is in the last event."""
        return None

    # ---- parts ----

    def _open_message(self) -> list[r.StreamEvent]:
        if self._open is not None:
            return []
        message = r.OutputMessage(id=_item_id("msg"), status="in_progress")
        self._items.append(message)
        self._open = message
        index = len(self._items) - 1
        part = r.OutputText(text="", logprobs=[] if self.request.returns_logprobs else None)
        events = [self._event(r.ItemEvent, "response.output_item.added", output_index=index,
                              item=message.model_copy(deep=True)),
                  self._event(r.PartEvent, "response.content_part.added", item_id=message.id, output_index=index,
                              content_index=0, part=part.model_copy(deep=True))]
        message.content.append(part)
        return events

    def _text_delta(self, text: str, logprobs: list[Any]) -> r.StreamEvent:
        part = self._open.content[0]
        part.text += text
        if part.logprobs is not None:
            part.logprobs += logprobs
        return self._event(r.TextDeltaEvent, "response.output_text.delta", item_id=self._open.id,
                           output_index=self._items.index(self._open), content_index=0, delta=text,
                           logprobs=logprobs)

    def _close_message(self, status: str) -> list[r.StreamEvent]:
        message, self._open = self._open, None
        if message is None:
            return []
        message.status = status
        index, part = self._items.index(message), message.content[0]
        at = {"item_id": message.id, "output_index": index, "content_index": 0}
        return [self._event(r.TextDoneEvent, "response.output_text.done", text=part.text,
                            logprobs=part.logprobs or [], **at),
                self._event(r.PartEvent, "response.content_part.done", part=part.model_copy(deep=True), **at),
                self._event(r.ItemEvent, "response.output_item.done", output_index=index,
                            item=message.model_copy(deep=True))]

    def _send_call(self, delta: ToolCallDelta) -> list[r.StreamEvent]:
        """A call arrives whole (the parser reads it out once it is complete): added, its arguments, done."""
        call = r.FunctionCall(id=_item_id("fc"), call_id=delta.id, name=delta.function.name, arguments="",
                              status="in_progress")
        self._items.append(call)
        index, arguments = len(self._items) - 1, delta.function.arguments or ""
        events = [self._event(r.ItemEvent, "response.output_item.added", output_index=index,
                              item=call.model_copy(deep=True)),
                  self._event(r.ArgumentsDeltaEvent, "response.function_call_arguments.delta", item_id=call.id,
                              output_index=index, delta=arguments),
                  self._event(r.ArgumentsDoneEvent, "response.function_call_arguments.done", item_id=call.id,
                              output_index=index, name=call.name, arguments=arguments)]
        call.arguments, call.status = arguments, "completed"
        events.append(self._event(r.ItemEvent, "response.output_item.done", output_index=index,
                                  item=call.model_copy(deep=True)))
        return events

    def _event(self, kind: type[r.StreamEvent], event_type: str, /, **fields: Any) -> r.StreamEvent:
        event = kind(type=event_type, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event

    def _finish_reason(self) -> str | None:
        finished = self.ctx.accounting.finished.get(0)
        return finished.finish_reason if finished is not None else None

    def _logprobs(self, generated: list[Any]) -> list[Any] | None:
        if not self.request.returns_logprobs:
            return None
        return self.ctx.formatter.chat(generated).content

    def _response(self, status: str, output: list[r.OutputItem], final: bool = False,
                  error: r.ResponseError | None = None) -> r.ResponseObject:
        """The response object; `final`: with usage and how speculation went; `error`: why it failed."""
        ctx, req = self.ctx, self.request
        text_format = req.text.format if req.text is not None and req.text.format is not None else None
        usage = speculation = None
        if final:
            totals = ctx.accounting.usage()
            cached = totals.prompt_tokens_details.cached_tokens if totals.prompt_tokens_details else 0
            usage = r.ResponseUsage(input_tokens=totals.prompt_tokens, output_tokens=totals.completion_tokens,
                                    total_tokens=totals.total_tokens,
                                    input_tokens_details=r.InputTokensDetails(cached_tokens=cached))
            speculation = ctx.accounting.speculation().model()
        return r.ResponseObject(
            id=ctx.rid, created_at=ctx.created, status=status, error=error,
            incomplete_details=r.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=ctx.served,
            output=[item.model_copy(deep=True) for item in output], parallel_tool_calls=req.parallel_tool_calls
            is not False, temperature=req.temperature, top_p=req.top_p, top_logprobs=req.top_logprobs,
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                  else {"type": "text"}},
            tool_choice=req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump")
            else (req.tool_choice or "auto"),
            tools=[t.model_dump(exclude_none=True) for t in req.function_tools()], user=req.user,
            metadata=req.metadata or {}, service_tier=req.service_tier, usage=usage,
            speculative_decoding=speculation)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _function_call(call: ToolCall, status: str) -> r.FunctionCall:
    return r.FunctionCall(id=_item_id("fc"), call_id=call.id, name=call.function.name,
                          arguments=call.function.arguments, status=status)
