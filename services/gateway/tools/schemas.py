"""OpenAI's tool shapes: what a request offers and asks (tools, tool_choice), what messages carry (assistant
tool_calls, tool results) and what responses return (tool_calls, and their streamed deltas)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOOLS = 128  # OpenAI's limit


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # every call is held to `parameters` when enforced; see docs/tool_calls.md


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @field_validator("function")
    @classmethod
    def _arguments_are_a_json_object(cls, value: FunctionCall) -> FunctionCall:
        try:
            parsed = json.loads(value.arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"function.arguments is not JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise ValueError("function.arguments must be a JSON object")  # noqa: TRY004 - pydantic wants ValueError
        return value


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ToolFields(BaseModel):
    """The chat request's tool fields (parallel_tool_calls lives with the sampling fields)."""

    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ToolFields:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return self

    def offered_tools(self) -> list[ToolDef]:
        """The tools the model sees: none with tool_choice "none"; only the named one when one is forced."""
        if not self.tools or self.tool_choice == "none":
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools)

    @property
    def forces_a_call(self) -> bool:
        return bool(self.offered_tools()) and (self.tool_choice == "required"
                                               or isinstance(self.tool_choice, NamedToolChoice))
