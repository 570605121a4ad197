"""The one request pipeline of /v1/completions and /v1/chat/completions: a request's prompts become choices
(one Generate call each), their events become a whole response or a stream through the kind's response builder
(response_builders.py), and every answered request is counted once in the metrics, however it ends.

Streaming responses wait for the first event before sending headers, so the verifier refusing a request (prompt
too long, overloaded) still yields a proper HTTP status; errors after that arrive as an SSE `error` object.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway import schemas as s
from services.gateway.errors import ApiError, from_grpc, internal_error
from services.gateway.generation import ChoiceEvent, ChoiceTimer, TextRules, merge, run_choice
from services.gateway.metrics import NO_METHOD
from services.gateway.request_body import parse_body, read_json
from services.gateway.request_log import log_request
from services.gateway.response_builders import (ChatResponses, ChoiceOutput, CompletionResponses, RequestContext,
                                                ResponseBuilder)
from services.gateway.responses import Accounting, LogprobFormatter, PromptReturn, sse
from services.gateway.sampling import bad_words_ids, build_request, predicted_ids, resolve_max_tokens
from services.gateway.state import GatewayState
from services.gateway.tokenizer import make_decode, token_text
from services.gateway.tools.output import ToolOutput

logger = logging.getLogger("specserve.gateway")

# Response ids by kind, as OpenAI's look (vLLM's too)
ID_PREFIXES = {"completion": "cmpl-", "chat": "chatcmpl-", "response": "resp_"}


@dataclass(frozen=True)
class Admitted:
    """A generation request read and checked: its body parsed, the model it names served, the tokenizer ready."""

    state: GatewayState
    req: Any  # the route's schema (s.CompletionRequest, s.ChatCompletionRequest)
    served: str
    tokenizer: Any


async def admit(request: Request, schema: type[s.SamplingFields]) -> Admitted:
    state: GatewayState = request.app.state.gateway
    req = parse_body(schema, await read_json(request, state.settings.max_request_body_bytes))
    served = await state.check_model(req.model)
    return Admitted(state, req, served, await state.get_tokenizer())


@dataclass(frozen=True)
class Choices:
    """What a route asks of the pipeline: its prompts (ids, after truncation), each run `n` times; `echo`, per
    prompt, the text a completion's choices start with ("" otherwise); the max_tokens asked (None: the rest of the
    context); `logprobs`, alternatives per generated token (None: none); what is returned of the prompt; how a
    chat's output is read for tool calls (None: not at all; `forced` holds a forced call's grammar); `max_field`:
    the request field that set requested_max, named when it does not fit the context."""

    prompts: list[list[int]]
    echo: list[str]
    requested_max: int | None
    logprobs: int | None
    returned: PromptReturn
    tools: ToolOutput | None = None
    max_field: str = "max_tokens"


DEFAULT_MAX_LOGPROBS = 20  # vLLM's, and a verifier's that does not say its own


def check_logprobs(req: s.SamplingFields, plan: Choices, limit: int) -> None:
    """At admission, the verifier's --max-logprobs: a 400 naming the field that asks more."""
    asked = [("top_logprobs" if isinstance(req, s.ChatCompletionRequest) else "logprobs", plan.logprobs),
             ("prompt_logprobs", req.prompt_logprobs)]
    for name, value in asked:
        if value is not None and value > limit:
            raise ApiError(400, f"{name} must be at most {limit} (the server's --max-logprobs), got {value}",
                           param=name)


async def generate(state: GatewayState, kind: str, req: s.SamplingFields, served: str, plan: Choices,
                   respond: Callable[[RequestContext], ResponseBuilder] | None = None) -> Response:
    """kind: "completion", "chat" or "response" (a chat request answered in the Responses API's shapes);
    respond: the builder of this kind's responses (default: the completion's or the chat's)."""
    req = state.generation_defaults.apply(req)  # vLLM's --generation-config: the model's defaults where req has none
    info = await state.model_info()
    check_logprobs(req, plan, info.max_logprobs if info.HasField("max_logprobs") else DEFAULT_MAX_LOGPROBS)
    tokenizer = state.tokenizer
    start = time.perf_counter()
    prefix = ID_PREFIXES[kind]
    internal = f"{prefix}{uuid.uuid4().hex}"  # the verifier's ids: unique whatever the client sends
    rid = f"{prefix}{req.request_id}" if req.request_id is not None else internal  # vLLM's request_id
    decode = make_decode(tokenizer, req.skip_special_tokens, req.spaces_between_special_tokens)
    rules = TextRules(req.stop_strings, req.include_stop_str_in_output, req.min_tokens,
                      frozenset(req.stop_token_ids or ()))
    bad_words = bad_words_ids(tokenizer, req.bad_words) if req.bad_words else []
    prediction = predicted_ids(tokenizer, req.predicted_text(), info.max_model_len)
    streams, choice_echo, choice_prompt, sampling = [], {}, {}, None
    for p, ids in enumerate(plan.prompts):
        max_tokens = resolve_max_tokens(plan.requested_max, len(ids), info.max_model_len, plan.max_field)
        if plan.requested_max is None:  # the room left in the context, or less where the model's default says so
            max_tokens = state.generation_defaults.default_max_tokens(max_tokens)
        for i in range(req.n):
            index = p * req.n + i
            choice_echo[index], choice_prompt[index] = plan.echo[p], ids
            grpc_req = build_request(req, request_id=f"{internal}-{index}", prompt_ids=ids, max_tokens=max_tokens,
                                     choice=index, logprobs=plan.logprobs, prompt_logprobs=plan.returned.wire,
                                     structured_output=plan.tools.forced if plan.tools is not None else None,
                                     bad_words=bad_words, prediction=prediction)
            streams.append(run_choice(state.client, grpc_req, index, decode, rules,
                                      ChoiceTimer(state.metrics, served, start)))
            sampling = grpc_req.sampling if sampling is None else sampling  # the first choice's, to log
    if state.settings.enable_log_requests:  # vLLM's --enable-log-requests
        log_request(rid, plan.prompts, sampling, tokenizer, state.settings.max_log_len)
    accounting = Accounting(prompt_tokens=sum(len(ids) for ids in plan.prompts), num_choices=len(streams),
                            predicted=prediction is not None)
    # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N" (for tokens that are not whole text)
    formatter = LogprobFormatter((lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids
                                 else (lambda t: token_text(tokenizer, t)), state.token_bytes())
    ctx = RequestContext(rid=rid, created=int(time.time()), served=served, req=req, formatter=formatter,
                         returned=plan.returned, logprobs=plan.logprobs, accounting=accounting,
                         choice_echo=choice_echo, choice_prompt=choice_prompt,
                         prompt_logprobs={i: [] for i in choice_echo})
    if respond is not None:
        builder = respond(ctx)
    else:
        builder = ChatResponses(ctx, plan.tools) if kind == "chat" else CompletionResponses(ctx)
    finish_metrics = _metrics_once(state, served, start, accounting)
    events = merge(streams)
    try:
        first = await anext(events)
    except grpc.RpcError as exc:
        await events.aclose()
        raise from_grpc(exc) from exc
    except StopAsyncIteration:
        raise ApiError(503, "the verifier returned no output") from None
    except asyncio.CancelledError:  # the client went away before the first token (disconnect.py)
        await events.aclose()
        finish_metrics()
        raise
    except BaseException:
        await events.aclose()
        raise

    async def all_events() -> AsyncIterator[ChoiceEvent]:
        yield first
        async for event in events:
            yield event

    if not req.stream:
        return await _whole(builder, events, all_events(), finish_metrics)
    return StreamingResponse(_stream(builder, events, all_events(), finish_metrics), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _metrics_once(state: GatewayState, served: str, start: float, accounting: Accounting) -> Callable[[], None]:
    """Records one answered request, once, however it ends: a choice that did not finish (the client went away,
    the stream broke) counts as `abort`."""
    recorded = False

    def finish_metrics() -> None:
        nonlocal recorded
        if recorded:
            return
        recorded = True
        spec = accounting.speculation()
        state.metrics.observe_request(served, spec.method or NO_METHOD, time.perf_counter() - start,
                                      accounting.prompt_tokens, accounting.usage().completion_tokens)
        reasons = [e.finish_reason for e in accounting.finished.values()]
        state.metrics.observe_finished(served, reasons + ["abort"] * (accounting.num_choices - len(reasons)))
        state.metrics.observe_speculation(served, spec.method, spec.num_drafts, spec.num_draft_tokens,
                                          spec.num_accepted_tokens)

    return finish_metrics


def _record(ctx: RequestContext, event: ChoiceEvent) -> None:
    ctx.accounting.record(event)
    ctx.prompt_logprobs[event.index] += event.prompt_logprobs


async def _whole(builder: ResponseBuilder, events: Any, all_events: AsyncIterator[ChoiceEvent],
                 finish_metrics: Callable[[], None]) -> Response:
    ctx = builder.ctx
    outputs = {i: ChoiceOutput("") for i in ctx.choice_echo}
    try:
        async with aclosing(events):
            async for event in all_events:
                out = outputs[event.index]
                out.text += event.text
                out.logprobs.extend(event.logprobs)
                out.token_ids += event.token_ids
                _record(ctx, event)
    except grpc.RpcError as exc:
        raise from_grpc(exc) from exc
    finally:  # also when the client disconnected and the work was cancelled
        finish_metrics()
    return JSONResponse(builder.whole(outputs).model_dump())


async def _stream(builder: ResponseBuilder, events: Any, all_events: AsyncIterator[ChoiceEvent],
                  finish_metrics: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in _chunks(builder, events, all_events, finish_metrics):
            yield chunk
    finally:  # also when the client went away mid-stream (Starlette closes this generator)
        finish_metrics()


async def _chunks(builder: ResponseBuilder, events: Any, all_events: AsyncIterator[ChoiceEvent],
                  finish_metrics: Callable[[], None]) -> AsyncIterator[bytes]:
    ctx, req = builder.ctx, builder.ctx.req
    async with aclosing(events):
        for chunk in builder.opening_chunks():
            yield sse(chunk)
        try:
            async for event in all_events:
                _record(ctx, event)
                if (not event.text and not event.logprobs and event.finish_reason is None
                        and not (ctx.ids_back and event.token_ids)):
                    continue
                last = ctx.accounting.all_finished and not req.include_usage
                chunk = builder.chunk(event, ctx.accounting.speculation().model() if last else None)
                if req.continuous_usage:
                    chunk.usage = ctx.accounting.usage_so_far()
                for one in _each(chunk):
                    yield sse(one)
        except (grpc.RpcError, ApiError) as exc:
            error = from_grpc(exc) if isinstance(exc, grpc.RpcError) else exc
            for chunk in builder.error_chunks(error):
                yield sse(chunk)
            if builder.ends_with_done:
                yield sse("[DONE]")
            return
        except Exception:  # the headers are sent: a bug ends the stream with an error event, not a reset
            logger.exception("unhandled error while streaming %s", ctx.rid)
            for chunk in builder.error_chunks(internal_error()):
                yield sse(chunk)
            if builder.ends_with_done:
                yield sse("[DONE]")
            return
    finish_metrics()
    for chunk in builder.closing_chunks():
        yield sse(chunk)
    if req.include_usage:
        yield sse(builder.usage_chunk())
    if builder.ends_with_done:
        yield sse("[DONE]")


def _each(chunk: Any) -> Iterable[Any]:
    """A builder's chunk for one event: one message (completions, chat) or several (the Responses API's events)."""
    return chunk if isinstance(chunk, list) else (chunk,)
