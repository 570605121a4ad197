"""Structured output requested through OpenAI's `response_format`, vLLM's `structured_outputs` or its older
`guided_*` extensions, as the verifier's StructuredOutput (proto/specserve/v1/verifier.proto). The verifier
compiles it against the target's tokenizer (a schema, regex or grammar that does not compile is its
INVALID_ARGUMENT, a 400 here) and masks every verified position with it, so output under speculation always
parses."""

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


# vLLM's structured-output backends a request may name (guided_decoding_backend): llguidance is vLLM's
# "guidance" backend, so those names (and "auto", the server's choice) give the same output here; the others
# compile grammars their own way (whitespace, JSON number forms) and could give other output, so they are refused.
SAME_BACKEND = frozenset({"auto", "guidance", "llguidance"})


def check_backend(value: str | None) -> str | None:
    if value is not None and value not in SAME_BACKEND:
        raise ValueError(f"guided_decoding_backend {value!r} is not available: this server's structured output is "
                         "llguidance (vLLM's 'guidance' backend); send 'guidance', 'auto' or nothing")
    return value


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its current field): exactly one of json, regex, choice, grammar,
    json_object. disable_fallback changes nothing here (one backend: nothing to fall back to); the options that
    would change how a grammar compiles are refused unless at their defaults."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        unsupported = {"disable_any_whitespace": self.disable_any_whitespace,
                       "disable_additional_properties": self.disable_additional_properties,
                       "whitespace_pattern": self.whitespace_pattern is not None,
                       "structural_tag": self.structural_tag is not None}
        refused = [name for name, asked in unsupported.items() if asked]
        if refused:
            raise ValueError(f"structured_outputs.{refused[0]} is not supported by this server (llguidance with "
                             "its default JSON whitespace); leave it out")
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object") if self.kind_value(name)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(kinds) or 'none'}")
        if isinstance(self.json_, str):
            try:
                json.loads(self.json_)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        return self

    def kind_value(self, name: str) -> Any:
        value = self.json_ if name == "json" else getattr(self, name)
        return None if value is None or value is False else value

    def proto(self) -> Any:
        if self.json_object:
            return pb.StructuredOutput(json_object=True)
        return grammar_proto(self.json_, self.regex, self.choice, self.grammar)


def grammar_proto(schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
                  grammar: str | None) -> Any | None:
    """The proto StructuredOutput of the first of these that is set (a JSON schema as an object or JSON text), or
    None: one mapping for vLLM's structured_outputs and its older guided_* fields."""
    if schema is not None:
        return pb.StructuredOutput(json_schema=schema if isinstance(schema, str) else json.dumps(schema))
    if regex is not None:
        return pb.StructuredOutput(regex=regex)
    if choice is not None:
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=choice))
    if grammar is not None:
        return pb.StructuredOutput(grammar=grammar)
    return None


class OutputConstraintFields(BaseModel):
    """The request fields that constrain the output; at most one of them may be set."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: str | None = Field(None, max_length=64)
    guided_json: dict[str, Any] | str | None = None  # vLLM: a JSON schema (object, or JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None  # llguidance Lark syntax, or GBNF

    @model_validator(mode="after")
    def _one_constraint(self) -> OutputConstraintFields:
        check_backend(self.guided_decoding_backend)
        named = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
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
        if self.structured_outputs is not None:
            return self.structured_outputs.proto()
        return grammar_proto(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
