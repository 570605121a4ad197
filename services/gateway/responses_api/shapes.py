"""What POST /v1/responses returns, in OpenAI's shapes: the response object, its output items (an assistant message
of output_text parts, function calls), its usage, and the events a stream sends (each with its `type` and
`sequence_number`, and named by its type on the SSE `event:` line, as OpenAI's server sends them)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from services.gateway.schemas import ChatTokenLogprob, SpeculativeDecoding


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None  # with include ["message.output_text.logprobs"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response failed (status "failed"): OpenAI's code (server_error, rate_limit_exceeded, invalid_prompt)
    and the message the chat route's error would carry."""

    code: str
    message: str


class ResponseObject(BaseModel):
    """The response; the request's settings are echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: None = None
    store: Literal[False] = False
    background: Literal[False] = False
    temperature: float | None
    top_p: float | None
    top_logprobs: int | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]
    service_tier: str | None
    speculative_decoding: SpeculativeDecoding | None = None  # extension, as on the other routes


class StreamEvent(BaseModel):
    """One event of a stream; `sse()` (responses.py) names it on the `event:` line."""

    NAMED_SSE_EVENT: ClassVar[bool] = True
    type: str
    sequence_number: int


class ResponseEvent(StreamEvent):  # response.created, .in_progress, .completed, .incomplete
    response: ResponseObject


class ItemEvent(StreamEvent):  # response.output_item.added, .done
    output_index: int
    item: OutputItem


class InPart(StreamEvent):
    """An event about one content part of one output item."""

    item_id: str
    output_index: int
    content_index: int


class PartEvent(InPart):  # response.content_part.added, .done
    part: OutputText


class TextDeltaEvent(InPart):  # response.output_text.delta
    delta: str
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class TextDoneEvent(InPart):  # response.output_text.done
    text: str
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ArgumentsDeltaEvent(StreamEvent):  # response.function_call_arguments.delta
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):  # response.function_call_arguments.done
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent):  # error: the stream failed after it began (then response.failed)
    code: str | None
    message: str
    param: str | None


RESPONSES_STREAM_EVENTS = (ResponseEvent, ItemEvent, PartEvent, TextDeltaEvent, TextDoneEvent, ArgumentsDeltaEvent,
                           ArgumentsDoneEvent, ErrorEvent)
