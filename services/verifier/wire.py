"""Protobuf <-> engine dataclasses for the Verifier service (proto/specserve/v1/verifier.proto).

Pure functions, so the servicer stays a thin shell and the translation rules (proto3's "0 means unset", the
server's default speculation) are tested without a server. Validation itself stays in the engine's dataclasses:
a bad value raises ValueError there, and the servicer maps that to INVALID_ARGUMENT once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from services.common.drafter_methods import PREDICTION
from services.common.protos import load
from services.verifier.outputs import FinishReason, RequestOutput, TokenLogprob
from services.verifier.prediction_proposer import PREDICTION_NUM_TOKENS
from services.verifier.request_mux import Update
from services.verifier.sampling_params import (
    GenerationRequest,
    OutputGrammar,
    SamplingParams,
    SpeculationParams,
)

verifier_pb2, verifier_pb2_grpc = load("verifier")

NO_SPECULATION = "none"

_FINISH_REASONS = {
    None: verifier_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: verifier_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: verifier_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: verifier_pb2.FINISH_REASON_ABORT,
}


@dataclass(frozen=True)
class DefaultSpeculation:
    """The server's --speculative-config as requests see it: method None means off by default; `num_tokens`
    is K whenever a request names a method without K."""

    method: str | None = None
    num_tokens: int = 5


def sampling_from_proto(message) -> SamplingParams:
    """proto3 scalars cannot be unset, so a 0 where 0 is invalid (top_p, repetition_penalty) means "disabled"
    (1.0): a client that sets only max_tokens gets plain sampling, not INVALID_ARGUMENT."""
    return SamplingParams(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        seed=message.seed if message.HasField("seed") else None,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        structured_output=grammar_from_proto(message.structured_output) if message.HasField("structured_output")
        else None,
        min_tokens=message.min_tokens,
        allowed_token_ids=tuple(message.allowed_token_ids),
        bad_words=tuple(tuple(word.token_ids) for word in message.bad_words),
    )


def grammar_from_proto(message) -> OutputGrammar:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output is set but names no kind (json_schema, json_object, regex, choice, grammar)")
    if kind == "json_object":
        return OutputGrammar("json_object")
    if kind == "choice":
        if not message.choice.choices:
            raise ValueError("structured_output choice needs at least one choice")
        return OutputGrammar("choice", json.dumps(list(message.choice.choices)))
    return OutputGrammar(kind, getattr(message, kind))


def speculation_from_proto(message, default: DefaultSpeculation) -> SpeculationParams:
    """"" -> the server default, or "prediction" for a request with prediction_token_ids; "none" -> off; a name ->
    that drafter (unknown names are the engine's to refuse). An unset K takes the default K (for a prediction, at
    least PREDICTION_NUM_TOKENS)."""
    prediction = tuple(message.prediction_token_ids)
    method = message.method or (PREDICTION if prediction else default.method)
    pipelining = message.draft_pipelining if message.HasField("draft_pipelining") else None
    if method is None or method == NO_SPECULATION:  # kept so that the engine can refuse them
        return SpeculationParams(draft_pipelining=pipelining, prediction=prediction)
    k = default.num_tokens if method != PREDICTION else max(default.num_tokens, PREDICTION_NUM_TOKENS)
    k = message.num_speculative_tokens if message.HasField("num_speculative_tokens") else k
    return SpeculationParams(method, k, pipelining, prediction)


def request_from_proto(message, request_id: str, default: DefaultSpeculation) -> GenerationRequest:
    """`request_id` is passed in so the caller decides what an empty id becomes."""
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=tuple(message.prompt_token_ids),
        sampling=sampling_from_proto(message.sampling),
        speculation=speculation_from_proto(message.speculation, default),
    )


def logprob_to_proto(item: TokenLogprob):
    return verifier_pb2.TokenLogprob(
        token_id=item.token_id,
        logprob=item.logprob,
        top=[verifier_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in item.top],
        rank=item.rank,
    )


def output_fields(output: RequestOutput, method: str) -> dict:
    """A GenerateResponse's fields as constructor arguments, submessages as dicts: upb builds the whole message in
    one call, where building it from messages copied each submessage in (and a RequestUpdate copied the response
    once more). `method`: the method the request drafted with ("" when speculation was off). Repeated fields only
    when there is something in them. 64 outputs as one GenerateMany message took 284 us built from messages, 174 us
    so (2-core EPYC, timeit), on the verifier's loop thread every step."""
    spec = output.spec
    fields = {
        "token_ids": output.token_ids,
        "finish_reason": _FINISH_REASONS[output.finish_reason],
        "usage": {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": output.num_output_tokens,
                  "cached_tokens": output.num_cached_tokens},
        "speculation": {"method": method, "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                        "num_accepted_tokens": spec.num_accepted_tokens},
        "stop_token_id": output.stop_token_id,
    }
    if output.logprobs:
        fields["logprobs"] = [logprob_to_proto(item) for item in output.logprobs]
    if output.prompt_logprobs:
        fields["prompt_logprobs"] = [logprob_to_proto(item) for item in output.prompt_logprobs]
    return fields


def output_to_proto(output: RequestOutput, method: str):
    """One Generate message (output_fields)."""
    return verifier_pb2.GenerateResponse(**output_fields(output, method))


def updates_to_proto(updates: Sequence[Update], status_of: Callable[[Exception], tuple[grpc.StatusCode, str]]):
    """One GenerateMany message: each update's output as Generate sends it, or its error with the status and
    message a Generate call would have ended with (`status_of`)."""
    message = verifier_pb2.StreamResponse()
    add = message.updates.add
    for update in updates:
        item = update.item
        if isinstance(item, Exception):
            code, details = status_of(item)
            add(request_id=update.request_id, error={"code": code.value[0], "message": details})
        else:
            add(request_id=update.request_id, output=output_fields(item, update.method))
    return message


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """The inverse mapping, for clients (the gateway) and tests."""
    for reason, number in _FINISH_REASONS.items():
        if number == value:
            return reason
    raise ValueError(f"unknown finish reason {value}")


@dataclass(frozen=True)
class ModelFacts:
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: Sequence[int]
    max_num_seqs: int
    tokenizer_fingerprint: str = ""  # services.modeling.tokenizer_fingerprint; "" when unknown
    max_logprobs: int = 20  # alternatives per position a request may ask (the engine's limit)


@dataclass(frozen=True)
class DrafterReport:
    """What Info says about one attached drafter (see drafter_status.TrackedProposer)."""

    name: str
    method: str
    address: str
    state: int  # verifier_pb2.DrafterState
    detail: str
    num_fallbacks: int


def info_to_proto(
    facts: ModelFacts,
    drafters: Sequence[DrafterReport],
    num_running: int,
    num_waiting: int,
    default: DefaultSpeculation,
):
    return verifier_pb2.InfoResponse(
        model_id=facts.model_id,
        max_model_len=facts.max_model_len,
        vocab_size=facts.vocab_size,
        eos_token_ids=sorted(facts.eos_token_ids),
        drafters=[
            verifier_pb2.DrafterStatus(
                name=d.name,
                method=d.method,
                address=d.address,
                state=d.state,
                detail=d.detail,
                num_fallbacks=d.num_fallbacks,
            )
            for d in drafters
        ],
        max_num_seqs=facts.max_num_seqs,
        num_running=num_running,
        num_waiting=num_waiting,
        default_speculative_method=default.method or "",
        default_num_speculative_tokens=default.num_tokens if default.method else 0,
        tokenizer_fingerprint=facts.tokenizer_fingerprint,
        max_logprobs=facts.max_logprobs,
        generate_many=True,  # servicer.GenerateMany
    )
