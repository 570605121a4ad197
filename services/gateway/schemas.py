"""Request and response bodies of /v1/completions and /v1/chat/completions, shaped like OpenAI's API.

Validation happens here, once, with OpenAI's documented ranges, so every bad value becomes a 400 naming the
field before anything reaches the verifier. Every field either works or is refused with a 400 that names it: a
field this server does not implement is never dropped silently, since that would change the answer the client
expects. A field sent as null counts as absent (SDKs echo assistant messages back with null fields). Fields that
cannot change the output by their nature (`user`, `safety_identifier`, `prompt_cache_key`, `metadata`,
`store: false`, `service_tier` "auto"/"default", `parallel_tool_calls` without tools) are accepted. The table of
every field: docs/openai_parameters.md.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from services.common.drafter_methods import PREDICTION
from services.common.method_options import MAX_SPECULATIVE_TOKENS
from services.common.sampling_rules import MAX_BAD_WORD_SEQUENCES, SEED_MAX, SEED_MIN
from services.gateway.structured_output import OutputConstraintFields
from services.gateway.tools.schemas import MAX_TOOLS, ToolCall, ToolCallDelta, ToolFields

MAX_N = 16
# Generate calls one request may start (prompts x n): more would fill the verifier's waiting queue by
# themselves, turning one client's request into everyone's 503s.
MAX_CHOICES = 64
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit
# Alternatives per position: the verifier's --max-logprobs bounds them (20 by default, vLLM's), and refuses more
# with a 400 that names the flag; this bound only keeps a request from asking beyond any vocabulary.
MAX_LOGPROBS = 2**20
MAX_BAD_WORDS = MAX_BAD_WORD_SEQUENCES // 2  # each is up to two token sequences: as written, and as a word start
MAX_BAD_WORD_CHARS = 100

class RefusesBooleansForNumbers(BaseModel):
    """A request model whose number fields refuse JSON booleans (refuse_booleans_for_numbers)."""

    @model_validator(mode="before")
    @classmethod
    def _no_booleans(cls, data: Any) -> Any:
        refuse_booleans_for_numbers(data, numeric_fields(cls))
        return data


class RequestSpeculativeConfig(RefusesBooleansForNumbers):
    """Per-request speculation (extension): `{"method": "ngram", "num_speculative_tokens": 3}` or
    `{"method": "none"}`. `method` names a drafter attached to the verifier; the verifier rejects unknown ones.
    `num_speculative_tokens`: the most draft tokens verified per step (a chain's length; for a drafter that sends
    token trees, the tokens its tree may hold).
    `draft_pipelining` (draft_model, eagle): the drafter drafts the next step while this one is verified; unset,
    the drafter's own setting; the verifier refuses it for drafters that do not pre-draft."""

    model_config = ConfigDict(extra="forbid")
    method: str = Field("", max_length=128)
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    draft_pipelining: bool | None = None


class StreamOptions(BaseModel):
    """OpenAI's stream_options (null counts as absent, as everywhere) and vLLM's continuous_usage_stats: usage in
    every chunk so far, not only in the last one (with include_usage, as vLLM reads it)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# Fields of OpenAI's or vLLM's API this server does not implement, refused with the reason.
UNSUPPORTED_FIELDS = {
    "tools": "tools are supported on /v1/chat/completions only",
    "tool_choice": "tools are supported on /v1/chat/completions only",
    "functions": "function calls are not supported by this server",
    "function_call": "function calls are not supported by this server",
    "best_of": "best_of is not supported (vLLM refuses it too); use n and score the choices yourself",
    "audio": "audio output is not supported: this server serves text-only models",
    "prediction": "predicted outputs are supported on /v1/chat/completions only",
    "reasoning_effort": "reasoning_effort is not supported by this server's models",
    "verbosity": "verbosity is not supported by this server's models",
    "web_search_options": "web search is not supported",
    "chat_template": "a chat template per request is not accepted: it would run the client's Jinja on the server "
                     "(vLLM too refuses it unless started with --trust-request-chat-template); the model's own "
                     "template is used, and chat_template_kwargs reach it",
    # vLLM's extensions this server does not implement (docs/openai_parameters.md, the compatibility table)
    "use_beam_search": "beam search is not supported (vLLM serves it on its own API too); use n",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "include_reasoning": "this server has no reasoning parser: reasoning stays in the content and cannot be left out",
    "documents": "documents are not passed to chat templates by this server",
    "mm_processor_kwargs": "this server serves text-only models",
    "prompt_embeds": "prompt embeddings are not accepted; send text or token ids",
    "structural_tag": "structural tags are not supported; use tools, response_format or structured_outputs",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (llguidance's default JSON whitespace)",
    "priority": "priority scheduling is not enabled: requests are served first come, first served (vLLM refuses "
                "a priority without --scheduling-policy priority too)",
    "logits_processors": "custom logits processors are not accepted: they would run the client's code in the "
                         "verifier; use logit_bias, allowed_token_ids, bad_words or structured output",
    "cache_salt": "cache_salt is not supported: the prefix cache is shared by every request of this server",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not supported",
    "vllm_xargs": "vllm_xargs (arguments for custom vLLM plugins) are not supported",
    "echo": "echo on chat (vLLM's: the last message prepended to the reply) is not supported",
}
# The value at which each of those asks for nothing (vLLM's defaults): accepted, as vLLM clients send them.
_OFF_VALUES = {"best_of": 1, "echo": False, "use_beam_search": False, "length_penalty": 1.0, "include_reasoning": True,
               "priority": 0, "cache_salt": ""}
# Fields for which even an empty value asks for something: `web_search_options: {}` turns web search on with its
# default settings (OpenAI's search models), so only its absence (or null) means "off".
_NO_OFF_VALUE = frozenset({"web_search_options"})
# Names the chat template is rendered with by this server: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                      "tokenize", "chat_template", "documents", "return_dict", "conversation"})


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do")
    return value


def refuse_unsupported(data: Any, known: set[str], unsupported: dict[str, str] = UNSUPPORTED_FIELDS) -> Any:
    """Before field validation: unknown keys sent as null are absent; a field this server does not implement
    (`unsupported`: name -> the reason) is a 400 with the reason unless it asks for nothing (unknown ones are
    refused by extra="forbid" afterwards)."""
    if not isinstance(data, dict):
        return data
    data = {k: v for k, v in data.items() if v is not None or k in known}
    for name, reason in unsupported.items():
        if name in data and name not in known and not _asks_nothing(name, data[name]):
            raise ValueError(f"{name}: {reason}")
    return {k: v for k, v in data.items() if not (k in unsupported and k not in known)}


def refuse_booleans_for_numbers(data: Any, numeric: frozenset[str]) -> None:
    """A JSON true or false where a field takes numbers (`max_tokens: true`, a prompt of `[true, 5]`, a logit_bias of
    `true`) is a 400 naming the field. Pydantic's lax mode reads them as 1 and 0 (vLLM's server takes them so);
    OpenAI refuses them, and a boolean where a count or a token id goes is a client's mistake, not a number."""
    if not isinstance(data, dict):
        return
    for name in numeric & data.keys():
        if _holds_a_boolean(data[name]):
            raise ValueError(f"{name}: expected numbers, got a boolean (true or false)")


TOKEN_ID_LIMIT = 2**32 - 1
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_LIMIT)]


def prompt_shape_problem(value: Any) -> str | None:
    """What keeps a completions prompt from being one of its four shapes (a string, strings, token ids, lists of
    token ids), naming the first wrong item; None where it fits one, or where pydantic's own message is clear."""
    if not isinstance(value, list):
        return None if isinstance(value, str) else f"prompt is {_json_kind(value)}"
    if all(isinstance(item, str) for item in value):
        return None
    if value and all(isinstance(item, list) for item in value):
        return next(filter(None, (_token_ids_problem(ids, f"prompt[{i}]") for i, ids in enumerate(value))), None)
    return _token_ids_problem(value, "prompt")


def _token_ids_problem(ids: list, where: str) -> str | None:
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int | float):
            return f"{where}[{i}] is {_json_kind(token)}, not a token id"
        if not 0 <= token <= TOKEN_ID_LIMIT or token != int(token):
            return f"{where}[{i}] is {token}, not a token id"
    return None


def _json_kind(value: Any) -> str:
    kinds = {str: "a string", list: "a list", dict: "an object", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


@functools.cache
def numeric_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` whose type admits integers or floats (in lists or dict values too) but not booleans."""
    return frozenset(name for name, info in model.model_fields.items()
                     if _admits(info.annotation, (int, float)) and not _admits(info.annotation, (bool,)))


def _admits(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a type admits one of `kinds`, looking through unions, Optional, Annotated, lists and dicts."""
    return annotation in kinds or any(_admits(arg, kinds) for arg in get_args(annotation))


def _holds_a_boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, list):
        return any(_holds_a_boolean(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_a_boolean(item) for item in value.values())
    return False


def _asks_nothing(name: str, value: Any) -> bool:
    """An unsupported field at the value that means "off": no tools, tool_choice "none", best_of 1, ..."""
    if name in _NO_OFF_VALUE:
        return False
    if name in _OFF_VALUES:
        off = _OFF_VALUES[name]
        return value == off and isinstance(value, bool) == isinstance(off, bool)  # True is not best_of 1
    return value in ([], {}) or (name == "tool_choice" and value == "none")


class SamplingFields(RefusesBooleansForNumbers, OutputConstraintFields):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    speculative_config: RequestSpeculativeConfig | None = None
    # OpenAI: added to the logits of these token ids (keys: token ids as strings) at every position
    logit_bias: dict[str, float] | None = None
    # Accepted because they cannot change the output (see the module docstring).
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's newer name for what `user` was for
    prompt_cache_key: str | None = None  # a cache hint: this server's prefix cache needs none and shares one cache
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, set(cls.model_fields))

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        for key, bias in value.items():
            if not key.strip().isdigit() or int(key) >= 2**32:  # the wire's ids are uint32
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:40]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    def predicted_text(self) -> str | None:
        """OpenAI's predicted output, where the route takes one (chat)."""
        return None

    # vLLM's extension: each prompt token's logprob (after the first) plus this many alternatives, under the
    # model's raw distribution, in the response's `prompt_logprobs` (not in streams: refused there, as vLLM does).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep only the prompt's last k tokens (-1: the model's max_model_len), before anything else reads it
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's token rules, applied by the verifier at every verified position (drafts included), so lossless:
    # no end-of-sequence or stop_token_ids token before min_tokens tokens (and no stop string matched before),
    # only allowed_token_ids, never a bad word (tokenized as vLLM does, sampling.bad_words_ids)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS)
    # vLLM's output options: the stop string or stop token's text kept at the end of the output; special tokens
    # in the text; the ids of prompt and output in the response; logprob tokens written as "token_id:N"
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: names the response (its `id` is cmpl-/chatcmpl- and this), e.g. to find it in logs
    request_id: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("bad_words")
    @classmethod
    def _words_not_blank(cls, value: list[str] | None) -> list[str] | None:
        if value and any(not word.strip() for word in value):
            raise ValueError("bad_words must not be blank")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _check_prompt_logprobs_stream(self) -> SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _positive_or_minus_one(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1, or -1 for the model's max_model_len")
        return value

    # Fields OpenAI's API declares nullable whose default is not null here: null counts as absent (the default).
    # Clients that write every parameter out (JS and Go SDKs' explicit nulls, proxies) send them so.
    NULL_AS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"stream", "n"})

    @model_validator(mode="before")
    @classmethod
    def _null_as_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.NULL_AS_DEFAULT):
            return {key: value for key, value in data.items() if not (value is None and key in cls.NULL_AS_DEFAULT)}
        return data

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every chunk (vLLM's stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    suffix: str | None = None
    NULL_AS_DEFAULT: ClassVar[frozenset[str]] = SamplingFields.NULL_AS_DEFAULT | {"echo"}
    echo: bool = False  # the prompt is prepended to each choice's text (and, with logprobs, to its logprobs)
    # 0 generates nothing (finish_reason "length"): with echo and logprobs it scores the prompt, as
    # lm-evaluation-harness does; allowed without echo too, as vLLM allows it.
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt (not around ids)

    @field_validator("prompt", mode="before")
    @classmethod
    def _explain_prompt_shape(cls, value):
        """A prompt that fits none of the four shapes would get pydantic's union report ("prompt.str: Input should
        be a valid string (and 3 more problems)"); say instead which item is wrong and what a prompt may be."""
        problem = prompt_shape_problem(value)
        if problem:
            raise ValueError(f"{problem}; a prompt is a string, a list of strings, a list of token ids (integers "
                             f"from 0) or a list of such lists")
        return value

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value):
        """Checked here rather than as a length bound on the union's list branches: pydantic would then report
        the union's first branch ("should be a valid string"), not the limit."""
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request, got {len(value)}; send several requests")
        return value

    @model_validator(mode="after")
    def _check_choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices per request (number of prompts x n); "
                             "send several requests")
        return self

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, value: str | None) -> str | None:
        if value:  # fill-in-the-middle needs model support this server does not have
            raise ValueError("suffix is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # developer: OpenAI's newer name for system instructions, rendered as system
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _check_message(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("role") == "tool" and not data.get("tool_call_id"):
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if data.get("tool_calls") and data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        parts = data.get("content")
        if isinstance(parts, list):
            for part in parts:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in (None, "text"):
                    raise ValueError(f"content parts of type {kind!r} are not supported: this server serves "
                                     "text-only models; send text parts")
        return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    def template_dict(self) -> dict[str, Any]:
        """As chat templates take it: text content ("" for none), tool calls with their arguments as objects."""
        message: dict[str, Any] = {"role": self.template_role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Prediction(BaseModel):
    """OpenAI's predicted output: text the reply is expected to mostly be (a file being edited). The verifier
    drafts from it, so matching text comes faster; the reply is the model's own whatever the prediction says."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    NULL_AS_DEFAULT: ClassVar[frozenset[str]] = SamplingFields.NULL_AS_DEFAULT | {"logprobs"}
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: render the conversation without the generation prompt, leaving the final assistant message open so
    # the model continues it (an assistant prefill)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: on top of those the chat template writes (rarely wanted)
    # vLLM's: extra variables for the model's chat template, e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's output types: ["text"] is what this server makes and is accepted; any other is refused
    modalities: list[str] | None = None
    # OpenAI's predicted outputs: drafted from by the verifier's "prediction" method (prediction_proposer.py)
    prediction: Prediction | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise ValueError(f'only ["text"] is supported: this server serves text-only models (got {value[:4]})')
        return value

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false (as in vLLM): the "
                             "final message is continued, no new one is started")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's to continue")
        method = self.speculative_config.method if self.speculative_config is not None else ""
        if self.prediction is not None and method not in ("", PREDICTION):
            raise ValueError(f"prediction is drafted from by speculative method {PREDICTION!r}, which "
                             f"speculative_config.method {method!r} would replace: leave the method out")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def predicted_text(self) -> str | None:
        return self.prediction.text if self.prediction is not None else None


# ---- responses ----------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    """With a prediction: its tokens the reply took as drafted, and those drafted that it did not (OpenAI's
    accepted/rejected_prediction_tokens, counted as the verifier verified them)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with a prediction only: left out otherwise

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("completion_tokens_details", ...) is None:
            del data["completion_tokens_details"]
        return data


class SpeculativeDecoding(BaseModel):
    """Extension: how speculation went for this response (summed over its choices)."""

    method: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float  # accepted / draft tokens
    mean_acceptance_length: float  # tokens committed per drafting step: 1 + accepted / drafts (vLLM's)


class ResponseEnvelope(BaseModel):
    """Fields every completion response and chunk shares; subclasses add `object` and `choices`."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    speculative_decoding: SpeculativeDecoding | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of vLLM's `prompt_logprobs`: its logprob, its rank in the distribution (1: most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: one entry per prompt token, None for the first, then {token id: PromptLogprob} holding the prompt
# token and the asked number of most likely alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _absent_if_none(value: Any) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop_token_ids token that ended the choice (None: end of sequence, length, ...)
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # extension, when asked (vLLM's field)
    # vLLM's return_token_ids: the prompt's ids (non-streamed, or a stream's first chunk) and the output's
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent_if_none)
    token_ids: list[int] | None = Field(None, exclude_if=_absent_if_none)


class CompletionResponse(ResponseEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is tool calls only
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda calls: calls is None)  # absent unless called


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's
    token_ids: list[int] | None = Field(None, exclude_if=_absent_if_none)  # vLLM's return_token_ids


class ChatCompletionResponse(ResponseEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None  # extension, when asked (vLLM's field: one prompt per chat)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent_if_none)  # vLLM's return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda calls: calls is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_absent_if_none)


class ChatCompletionChunk(ResponseEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent_if_none)


class CompletionChunk(ResponseEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    root: str | None = None  # vLLM's: the model the server loaded (its --model), which `id` may rename
    parent: str | None = None  # vLLM's: the base model of an adapter; none here (no LoRA)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body (errors.ApiError), as OpenAI's API shapes it."""

    error: ErrorDetail


class DrafterHealth(BaseModel):
    name: str
    method: str
    address: str
    state: Literal["serving", "degraded", "disconnected", "refused", "unknown"]
    detail: str
    num_fallbacks: int


class Health(BaseModel):
    """`GET /health`. With an API key set, only `status`: the endpoint is open, the addresses are not."""

    status: Literal["ok", "degraded", "starting", "unavailable"]
    model: str | None = None
    verifier: str | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    drafters: list[DrafterHealth] | None = None
    error: str | None = None

    def public(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
