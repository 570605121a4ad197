"""Structured output requested through OpenAI's `response_format` or vLLM's `guided_*` extensions, as the
verifier's StructuredOutput (proto/specserve/v1/verifier.proto). The verifier compiles it against the target's
tokenizer (a schema, regex or grammar that does not compile is its INVALID_ARGUMENT, a 400 here) and masks every
verified position with it, so output under speculation always parses."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.verifier_client import pb


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # OpenAI's strict mode supports a subset of JSON schema; here every schema is enforced exactly (the output is
    # masked by it), so strict true and false both hold the output to the schema.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object ({"name": ..., "schema": {...}})')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'json_schema is only for type "json_schema", not {self.type!r}')
        return self


class OutputConstraintFields(BaseModel):
    """The request fields that constrain the output; at most one of them may be set."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM: a JSON schema (object, or JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None  # llguidance Lark syntax, or GBNF

    @model_validator(mode="after")
    def _one_constraint(self) -> OutputConstraintFields:
        named = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            named.insert(0, "response_format")
        if len(named) > 1:
            raise ValueError(f"set at most one output constraint, got {', '.join(named)}")
        if isinstance(self.guided_json, str):
            try:
                json.loads(self.guided_json)
            except json.JSONDecodeError as error:
                raise ValueError(f"guided_json is not valid JSON: {error}") from None
        return self

    def structured_output(self) -> Any | None:
        """The proto StructuredOutput, or None for unconstrained output."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return pb.StructuredOutput(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
            return pb.StructuredOutput(json_schema=json.dumps(schema))
        if self.guided_json is not None:
            text = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            return pb.StructuredOutput(json_schema=text)
        if self.guided_regex is not None:
            return pb.StructuredOutput(regex=self.guided_regex)
        if self.guided_choice is not None:
            return pb.StructuredOutput(choice=pb.ChoiceList(choices=self.guided_choice))
        if self.guided_grammar is not None:
            return pb.StructuredOutput(grammar=self.guided_grammar)
        return None
