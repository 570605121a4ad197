"""The body of POST /v1/responses (OpenAI's Responses API), checked, and turned into the chat request it means.

A response is a chat completion in another shape: `instructions` and `input` become the messages the model's chat
template renders, `max_output_tokens` is max_tokens, `text.format` is response_format, function tools are chat
tools. So the route runs the chat pipeline, with every chat check, and only the shapes in and out are its own.

What this server does not do is refused with a 400 that names the field, never dropped: stored responses
(`store: true`, `previous_response_id`, `conversation`: nothing is kept between requests, so the client sends the
conversation's items in `input`), background runs, hosted tools (web search, file search, ...), reasoning options,
`truncation: "auto"`, and input parts that are not text. `store` left out means false here, where OpenAI's default
is true; the response says `"store": false`, as vLLM's does.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from services.gateway.errors import from_validation
from services.gateway.schemas import (MAX_TOKENS_LIMIT, RefusesBooleansForNumbers, RequestSpeculativeConfig,
                                      refuse_unsupported)
from services.gateway.tools.schemas import MAX_TOOLS

LOGPROBS_INCLUDE = "message.output_text.logprobs"

NOT_STORED = ("responses are not stored by this server: send the conversation's earlier items (messages, "
              "function_call and function_call_output items) in input")
# Fields of OpenAI's Responses API this server does not implement, refused with the reason unless null or empty.
UNSUPPORTED = {
    "previous_response_id": NOT_STORED,
    "conversation": NOT_STORED,
    "prompt": "reusable prompts (prompt templates stored at OpenAI) are not supported; send input",
    "max_tool_calls": "max_tool_calls is not supported; limit calls with tool_choice and parallel_tool_calls",
    "context_management": "context management (compaction) is not supported",
}


class InputText(BaseModel):
    """A text part of an input message: input_text (user, system, developer) or output_text (an assistant's
    earlier output, as a response's `output` item sent back)."""

    model_config = ConfigDict(extra="ignore")  # output_text carries annotations and logprobs: not rendered
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an earlier output item sent back
    status: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for part in data["content"]:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("input_text", "output_text", "text"):
                    raise ValueError(f"content parts of type {kind!r} are not supported: this server serves "
                                     "text-only models; send input_text parts")
        return data

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier (a response's function_call output item, sent back)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"arguments is not JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object")
        return value


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model to read."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: text, any JSON object, or a JSON schema (name, schema, strict, description)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError('type "json_schema" needs a name and a schema')
        if self.type != "json_schema" and (self.schema_ is not None or self.name is not None):
            raise ValueError(f'name and schema are only for type "json_schema", not {self.type!r}')
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("verbosity is not supported by this server's models")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # OpenAI pads stream events with random `obfuscation` text against length side channels; this server sends
    # none, which cannot change the output
    include_obfuscation: bool | None = None


class ResponsesRequest(RefusesBooleansForNumbers):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    background: bool | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, None] | None = None
    # cannot change the output (as on the chat route): identifiers, a cache hint, labels echoed back
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: Literal["auto", "default"] | None = None
    speculative_config: RequestSpeculativeConfig | None = None  # specserve's, as on the chat route

    NULL_AS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"stream"})
    _items: list[InputItem] = PrivateAttr(default_factory=list)
    _tools: list[FunctionTool] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        data = refuse_unsupported(data, set(cls.model_fields), UNSUPPORTED)
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None or k not in cls.NULL_AS_DEFAULT}
        if data.get("store") is True:
            raise ValueError(f"store: {NOT_STORED}; send store false or leave it out")
        if data.get("background") is True:
            raise ValueError("background: background responses are not supported (they are stored, and nothing is)")
        if data.get("truncation") == "auto":
            raise ValueError('truncation: "auto" (dropping the conversation\'s first items to fit) is not '
                             'supported; an input over the context is a 400 with its length')
        if isinstance(data.get("reasoning"), dict) and any(v is not None for v in data["reasoning"].values()):
            raise ValueError("reasoning: reasoning options are not supported by this server's models")
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _explain_input_shape(cls, value: Any) -> Any:
        """Say what input may be, rather than pydantic's report of each branch of the union."""
        if isinstance(value, list):
            wrong = next((i for i, item in enumerate(value) if not isinstance(item, dict)), None)
            if wrong is not None:
                raise ValueError(f"input[{wrong}] is not an object; input is a string or a list of items (messages, "
                                 "function_call and function_call_output objects)")
        elif not isinstance(value, str):
            raise ValueError("input is a string or a list of items (messages, function_call and "
                             "function_call_output objects)")
        return value

    @model_validator(mode="after")
    def _parse_items_and_tools(self) -> ResponsesRequest:
        if isinstance(self.input, str):
            self._items = [MessageItem(role="user", content=self.input)]
        elif not self.input:
            raise ValueError("input must not be empty")
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}]: items of type {kind!r} are not supported; send messages, "
                                 "function_call and function_call_output items")
            self._items.append(_parsed(ITEM_TYPES[kind], item, f"input[{i}]"))
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise ValueError(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; only "
                                 "function tools, which the client runs")
            self._tools.append(_parsed(FunctionTool, tool, f"tools[{i}]"))
        names = [t.name for t in self._tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        return self

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        other = sorted(set(value or ()) - {LOGPROBS_INCLUDE})
        if other:
            raise ValueError(f"{other[0]!r} cannot be included: this server returns only "
                             f"{LOGPROBS_INCLUDE!r} (the output's logprobs)")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _logprobs_with_text_only(self) -> ResponsesRequest:
        if self.returns_logprobs and self.tools and self.tool_choice != "none":
            raise ValueError("include: logprobs are returned with text output, not with tools")
        return self

    @property
    def returns_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_items(self) -> list[InputItem]:
        return list(self._items)

    def function_tools(self) -> list[FunctionTool]:
        return list(self._tools)

    def chat_body(self) -> dict[str, Any]:
        """The /v1/chat/completions body this request means (validated by the chat schema after this)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "stream": self.stream,
            "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
            "safety_identifier": self.safety_identifier, "prompt_cache_key": self.prompt_cache_key,
            "metadata": self.metadata, "service_tier": self.service_tier,
        }
        if self.speculative_config is not None:
            body["speculative_config"] = self.speculative_config.model_dump(exclude_none=True)
        if self.returns_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.function_tools()]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in schema.items() if v is not None}}
        return {k: v for k, v in body.items() if v is not None}

    def _messages(self) -> list[dict[str, Any]]:
        """Instructions first, as a system message; consecutive function calls become one assistant message."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.input_items():
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages


def _parsed(model: type[BaseModel], data: Any, where: str) -> Any:
    """`data` as `model`, or a ValueError naming the first problem's place inside the request (`where`)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        refused = from_validation(error)  # the route's own wording: "field.path: problem"
        raise ValueError(f"{where}{'.' if refused.param else ': '}{refused.message}") from None
