"""The FastAPI application: OpenAI routes, health, metrics.

Bodies are read and parsed by hand (size limit, strict UTF-8, JSON, then pydantic) so every failure has the
OpenAI error shape and a 400/413 status rather than FastAPI's 422 (request_body.py; openapi.py documents the
bodies all the same). Streaming responses wait for the first token before sending headers, so the verifier
refusing a request (prompt too long, overloaded) still yields a proper HTTP status; errors after that arrive as
an SSE `error` object. A bug anywhere in a route is still an OpenAI-shaped 500, logged once and counted.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from services.gateway import schemas as s
from services.gateway import tokenize_routes
from services.gateway.chat_prompt import chat_prompt_ids
from services.gateway.disconnect import unless_disconnected
from services.gateway.errors import ApiError, from_grpc, install_error_handlers, internal_error
from services.gateway.generation import ChoiceEvent, ChoiceTimer, TextRules, merge, run_choice
from services.gateway.metrics import NO_METHOD, GatewayMetrics
from services.gateway.openapi import error_responses, generation_docs, install_openapi
from services.gateway.request_body import parse_body, read_json
from services.gateway.responses import Accounting, LogprobFormatter, PromptReturn, joined, sse
from services.gateway.sampling import bad_words_ids, build_request, resolve_max_tokens, truncate_prompt
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizer import decode_prompt, encode_prompt, load_tokenizer, make_decode, token_text
from services.gateway.tools.grammar import forced_call_grammar
from services.gateway.tools.output import StreamedChoice, ToolOutput
from services.gateway.tools.parsers import tool_call_format
from services.gateway.verifier_client import VerifierClient, pb
from services.modeling.model_source import ModelUnavailableError
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint

_DRAFTER_STATES = {pb.DRAFTER_STATE_SERVING: "serving", pb.DRAFTER_STATE_DISCONNECTED: "disconnected",
                   pb.DRAFTER_STATE_REFUSED: "refused", pb.DRAFTER_STATE_DEGRADED: "degraded",
                   pb.DRAFTER_STATE_UNSPECIFIED: "unknown"}
_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize",
           "/version"}
MODEL_ROUTE = "/v1/models/{model}"  # one metrics label for every model id asked for

logger = logging.getLogger("specserve.gateway")


@dataclass
class GatewayState:
    """What the routes share: settings, the verifier client, the tokenizer, metrics, and the verifier's model
    facts (fetched once, on first need, so the gateway can start before the verifier)."""

    settings: GatewaySettings
    client: VerifierClient
    metrics: GatewayMetrics
    tokenizer: Any = None
    tokenizer_problem: str | None = None  # why the tokenizer cannot be had (then the gateway is not ready)
    info: Any = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def model_info(self) -> Any:
        if self.info is None:
            async with self._lock:
                if self.info is None:
                    try:
                        info = await self.client.info()
                    except grpc.RpcError as exc:
                        raise from_grpc(exc) from exc
                    if self.tokenizer is not None:
                        await self._check_tokenizer(info, self.tokenizer)
                    self.info = info
        return self.info

    async def get_tokenizer(self) -> Any:
        """The tokenizer, for a request: never loaded (nor its model fetched) here. Until prepare() has it, a
        503 that says why: the verifier is unreachable, the tokenizer is loading, or it cannot be had."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.tokenizer_problem is not None:
            raise ApiError(503, self.tokenizer_problem, code="model_unavailable")
        await self.model_info()  # the verifier's own 503 while it is unreachable
        raise ApiError(503, "the gateway is starting: its tokenizer is loading; retry in a few seconds",
                       code="not_ready")

    async def prepare(self, retry_s: float = 0.5) -> None:
        """Load the tokenizer once, at start-up: the --model one, else that of the model the verifier serves
        (asked until it answers). A model that cannot be found or fetched leaves `tokenizer_problem` set: the
        gateway stays up, not ready, and says why on /health and in every 503."""
        while self.tokenizer is None:
            try:
                spec = self.settings.model or (await self.model_info()).model_id
            except ApiError:  # the verifier is not up yet: the gateway may start first
                await asyncio.sleep(retry_s)
                continue
            try:
                tokenizer = await run_in_threadpool(load_tokenizer, spec)
                if self.info is not None:
                    await self._check_tokenizer(self.info, tokenizer)
            except ModelUnavailableError as error:
                self.tokenizer_problem = str(error)
                logger.error("gateway not ready: %s", error)
                return
            except ApiError as error:  # tokenizer_mismatch
                self.tokenizer_problem = error.message
                logger.error("gateway not ready: %s", error.message)
                return
            except Exception as error:  # noqa: BLE001 - a bad file or folder: not ready, and why, not a dead task
                self.tokenizer_problem = f"the tokenizer of model {spec!r} could not be loaded: {error}"
                logger.exception("gateway not ready: %s", self.tokenizer_problem)
                return
            self.tokenizer = tokenizer

    async def _check_tokenizer(self, info: Any, tokenizer: Any) -> None:
        """Ids from a tokenizer with another vocabulary would mean other tokens to the verifier's model."""
        if not info.tokenizer_fingerprint:
            return
        ours = await run_in_threadpool(tokenizer_fingerprint, tokenizer)
        if ours and ours != info.tokenizer_fingerprint:
            raise ApiError(
                503,
                f"the gateway's tokenizer (--model {self.settings.model or info.model_id}) does not match the "
                f"verifier's model {info.model_id!r} (vocabulary fingerprints {ours[:12]} vs "
                f"{info.tokenizer_fingerprint[:12]}); start the gateway with the verifier's --model",
                code="tokenizer_mismatch",
            )

    async def served_name(self) -> str:
        return self.settings.served_model_name or (await self.model_info()).model_id

    async def check_model(self, name: str | None) -> str:
        """The served name; a 404 when a request names another model (None: the request may leave it out)."""
        served = await self.served_name()
        if name is not None and name != served:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{served}`.",
                           param="model", code="model_not_found")
        return served


def create_app(settings: GatewaySettings, tokenizer: Any = None, client: VerifierClient | None = None) -> FastAPI:
    client = client or VerifierClient(settings.verifier, info_timeout_s=settings.info_timeout_s,
                                      request_timeout_s=settings.request_timeout_s,
                                      root_cert=settings.grpc_root_cert)
    state = GatewayState(settings=settings, client=client, metrics=GatewayMetrics(), tokenizer=tokenizer)
    call_format = tool_call_format(settings.tool_call_parser)  # an unknown name fails at start-up

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        preparing = asyncio.create_task(state.prepare(), name="specserve-gateway-prepare")
        yield
        preparing.cancel()
        await client.close()

    app = FastAPI(title="specserve gateway", lifespan=lifespan)
    app.state.gateway = state
    install_error_handlers(app)
    install_openapi(app, [s.CompletionRequest, s.ChatCompletionRequest, *tokenize_routes.REQUEST_MODELS],
                    [s.CompletionChunk, s.ChatCompletionChunk])

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        """Counts every response, a bug's 500 included: an exception no handler knows reaches this middleware
        through call_next, so it is logged (once, with its traceback) and answered here."""
        try:
            response = await call_next(request)
        except Exception:
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
            response = internal_error().response()
        path = request.url.path
        path = path if path in _ROUTES else MODEL_ROUTE if path.startswith("/v1/models/") else "other"
        state.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    async def require_api_key(request: Request) -> None:
        key = settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.get_secret_value().encode()):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    app.include_router(tokenize_routes.create_router(require_api_key))

    @app.get("/health", responses={200: {"model": s.Health}, 503: {"model": s.Health}})
    async def health() -> JSONResponse:
        """Open even with an API key (load balancers probe it), so then it tells the status only: the
        verifier's and drafters' addresses and error details are for operators, on the metrics and logs."""
        report = await _health(client, state)
        body = s.Health(status=report.status) if settings.api_key is not None else report
        return JSONResponse(body.public(), status_code=200 if report.status in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)],
             responses={200: {"model": s.ModelList}, **error_responses(401, 500, 503)})
    async def models() -> JSONResponse:
        info = await state.model_info()
        card = s.ModelCard(id=await state.served_name(), created=int(time.time()), root=info.model_id,
                           max_model_len=info.max_model_len or None)
        return JSONResponse(s.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)],
             responses={200: {"model": s.ModelCard}, **error_responses(401, 404, 500, 503)})
    async def model(model_id: str) -> JSONResponse:
        info = await state.model_info()
        served = await state.check_model(model_id)
        card = s.ModelCard(id=served, created=int(time.time()), root=info.model_id,
                           max_model_len=info.max_model_len or None)
        return JSONResponse(card.model_dump())

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)],
              **generation_docs(s.CompletionRequest, s.CompletionResponse, s.CompletionChunk))
    async def completions(request: Request) -> Response:
        req: s.CompletionRequest = parse_body(s.CompletionRequest, await read_json(request,
                                                                               settings.max_request_body_bytes))
        served = await state.check_model(req.model)
        tokenizer = await state.get_tokenizer()
        encoded = [await run_in_threadpool(encode_prompt, tokenizer, p, req.add_special_tokens) for p in req.prompts()]
        limit = (await state.model_info()).max_model_len
        prompts = [truncate_prompt(ids, req.truncate_prompt_tokens, limit) for ids in encoded]
        # echo returns the prompt as sent (as kept, when truncated); a token-id prompt decoded with its special
        # tokens, as vLLM echoes it and as the echoed logprobs list its tokens (their text_offset index this text)
        echo = [(p if isinstance(p, str) and len(ids) == len(whole) else decode_prompt(tokenizer, ids))
                if req.echo else "" for p, whole, ids in zip(req.prompts(), encoded, prompts, strict=True)]
        returned = PromptReturn(echo=req.echo, echo_logprobs=req.logprobs if req.echo else None,
                                prompt_logprobs=req.prompt_logprobs)
        return await unless_disconnected(
            request, _generate(state, "completion", req, served, prompts, req.max_tokens, req.logprobs, echo,
                               returned)
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)],
              **generation_docs(s.ChatCompletionRequest, s.ChatCompletionResponse, s.ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        req: s.ChatCompletionRequest = parse_body(s.ChatCompletionRequest,
                                              await read_json(request, settings.max_request_body_bytes))
        served = await state.check_model(req.model)
        tokenizer = await state.get_tokenizer()
        tools = req.offered_tools()
        ids = await chat_prompt_ids(tokenizer, req, tools)
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, (await state.model_info()).max_model_len)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await unless_disconnected(
            request, _generate(state, "chat", req, served, [ids], req.requested_max_tokens, logprobs, [""],
                               PromptReturn(prompt_logprobs=req.prompt_logprobs), tool_output(req, tools))
        )

    def tool_output(req: s.ChatCompletionRequest, tools: list) -> ToolOutput | None:
        """How this request's output is read for tool calls (None: it offers none); a forced call's grammar."""
        if not tools:
            return None
        forced = None
        if req.forces_a_call:
            if req.structured_output() is not None:
                raise ApiError(400, "tool_choice forcing a call cannot be combined with response_format, "
                                    "structured_outputs or guided_* (the call's grammar is the output's)",
                               param="tool_choice")
            several = req.tool_choice == "required" and req.parallel_tool_calls is not False
            forced = pb.StructuredOutput(grammar=forced_call_grammar(tools, call_format, several=several))
        return ToolOutput(call_format, forced)

    return app


async def _health(client: VerifierClient, state: GatewayState) -> s.Health:
    """Ready (200: ok or degraded) only with the tokenizer loaded and the verifier answering."""
    if state.tokenizer_problem is not None:
        return s.Health(status="unavailable", verifier=client.address, error=state.tokenizer_problem)
    try:
        info = await client.info()
    except grpc.RpcError as exc:
        return s.Health(status="unavailable", verifier=client.address, error=from_grpc(exc).message)
    if state.tokenizer is None:
        return s.Health(status="starting", model=info.model_id, verifier=client.address,
                        error="loading the tokenizer")
    drafters = [s.DrafterHealth(name=d.name, method=d.method, address=d.address,
                                state=_DRAFTER_STATES.get(d.state, "unknown"), detail=d.detail,
                                num_fallbacks=d.num_fallbacks) for d in info.drafters]
    degraded = any(d.state != "serving" for d in drafters)
    return s.Health(status="degraded" if degraded else "ok", model=info.model_id, verifier=client.address,
                    num_running=info.num_running, num_waiting=info.num_waiting, drafters=drafters)


async def _generate(state: GatewayState, kind: str, req: s.SamplingFields, served: str,
                    prompts: list[list[int]], requested_max: int | None, logprobs: int | None,
                    echo: list[str], returned: PromptReturn, tools: ToolOutput | None = None) -> Response:
    """tools: how a chat choice's output is read for tool calls (None: not at all)."""
    info = await state.model_info()
    tokenizer = state.tokenizer
    start = time.perf_counter()
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    internal = f"{prefix}-{uuid.uuid4().hex}"  # the verifier's ids: unique whatever the client sends
    rid = f"{prefix}-{req.request_id}" if req.request_id is not None else internal  # vLLM's request_id
    created = int(time.time())
    decode = make_decode(tokenizer, req.skip_special_tokens, req.spaces_between_special_tokens)
    rules = TextRules(req.stop_strings, req.include_stop_str_in_output, req.min_tokens,
                      frozenset(req.stop_token_ids or ()))
    bad_words = bad_words_ids(tokenizer, req.bad_words) if req.bad_words else []
    streams, choice_echo, choice_prompt = [], {}, {}
    for p, ids in enumerate(prompts):
        param_max = resolve_max_tokens(requested_max, len(ids), info.max_model_len)
        for i in range(req.n):
            index = p * req.n + i
            choice_echo[index], choice_prompt[index] = echo[p], ids
            grpc_req = build_request(req, request_id=f"{internal}-{index}", prompt_ids=ids, max_tokens=param_max,
                                     choice=index, logprobs=logprobs, prompt_logprobs=returned.wire,
                                     structured_output=tools.forced if tools is not None else None,
                                     bad_words=bad_words)
            timer = ChoiceTimer(state.metrics, served, start)
            streams.append(run_choice(state.client, grpc_req, index, decode, rules, timer))
    accounting = Accounting(prompt_tokens=sum(len(ids) for ids in prompts), num_choices=len(streams))
    # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N" (for tokens that are not whole text)
    formatter = LogprobFormatter((lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids
                                 else (lambda t: token_text(tokenizer, t)))
    ids_back = req.return_token_ids  # vLLM's return_token_ids: prompt and output ids in the response
    events = merge(streams)
    prompt_lps: dict[int, list[Any]] = {i: [] for i in choice_echo}  # the verifier's, from each first message

    def completion_logprobs(index: int, generated: list[Any], offset: int, with_prompt: bool) -> s.CompletionLogprobs:
        out = formatter.completion(generated, offset)
        if with_prompt and returned.echo_logprobs is not None:
            out = joined(formatter.echoed_prompt(choice_prompt[index], prompt_lps[index], returned.echo_logprobs), out)
        return out

    recorded = False

    def finish_metrics() -> None:
        """Once per answered request, however it ends: a choice that did not finish (the client went away, the
        stream broke) counts as `abort`."""
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
        texts = {i: choice_echo[i] for i in choice_echo}
        lps: dict[int, list[Any]] = {i: [] for i in choice_echo}
        out_ids: dict[int, list[int]] = {i: [] for i in choice_echo}
        try:
            async with aclosing(events):
                async for event in all_events():
                    texts[event.index] += event.text
                    lps[event.index].extend(event.logprobs)
                    out_ids[event.index] += event.token_ids
                    prompt_lps[event.index] += event.prompt_logprobs
                    accounting.record(event)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from exc
        finally:  # also when the client disconnected and the work was cancelled
            finish_metrics()
        reasons = {i: e.finish_reason for i, e in accounting.finished.items()}
        stop_reasons = {i: e.stop_reason for i, e in accounting.finished.items()}
        if kind == "chat":
            messages = {}
            for i, text in texts.items():
                content, calls, reason = (tools.message(text, reasons.get(i)) if tools is not None
                                          else (text, None, reasons.get(i)))
                messages[i], reasons[i] = s.AssistantMessage(content=content, tool_calls=calls), reason
            body: BaseModel = s.ChatCompletionResponse(
                id=rid, created=created, model=served, usage=accounting.usage(),
                speculative_decoding=accounting.speculation().model(),
                choices=[s.ChatChoice(index=i, message=messages[i],
                                      logprobs=formatter.chat(lps[i]) if logprobs is not None else None,
                                      finish_reason=reasons.get(i), stop_reason=stop_reasons.get(i),
                                      token_ids=out_ids[i] if ids_back else None) for i in sorted(texts)],
                prompt_logprobs=formatter.prompt_logprobs(prompt_lps[0], returned.prompt_logprobs)
                if returned.prompt_logprobs is not None else None,
                prompt_token_ids=choice_prompt[0] if ids_back else None)
        else:
            body = s.CompletionResponse(
                id=rid, created=created, model=served, usage=accounting.usage(),
                speculative_decoding=accounting.speculation().model(),
                choices=[s.CompletionChoice(index=i, text=texts[i], finish_reason=reasons.get(i),
                                            stop_reason=stop_reasons.get(i),
                                            logprobs=completion_logprobs(i, lps[i], len(choice_echo[i]), True)
                                            if logprobs is not None else None,
                                            prompt_logprobs=formatter.prompt_logprobs(prompt_lps[i],
                                                                                      returned.prompt_logprobs)
                                            if returned.prompt_logprobs is not None else None,
                                            prompt_token_ids=choice_prompt[i] if ids_back else None,
                                            token_ids=out_ids[i] if ids_back else None)
                         for i in sorted(texts)])
        return JSONResponse(body.model_dump())

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for chunk in stream_chunks():
                yield chunk
        finally:  # also when the client went away mid-stream (Starlette closes this generator)
            finish_metrics()

    async def stream_chunks() -> AsyncIterator[bytes]:
        offsets = {i: len(choice_echo[i]) for i in choice_echo}
        # echo (completions): the prompt's text, and with logprobs its tokens' logprobs, lead the choice's first
        # chunk, which waits for the verifier's first message (it carries the prompt logprobs), as in vLLM
        unechoed = set(choice_echo) if returned.echo else set()
        unsent_prompt_ids = set(choice_echo) if ids_back and kind != "chat" else set()
        calls = {i: StreamedChoice(tools) for i in choice_echo} if tools is not None else {}
        async with aclosing(events):
            if kind == "chat":  # the first chunk of each choice carries the role (and the prompt's ids, asked)
                for i in sorted(choice_echo):
                    yield sse(s.ChatCompletionChunk(id=rid, created=created, model=served, choices=[
                        s.ChatChunkChoice(index=i, delta=s.ChatDelta(role="assistant", content=""))],
                        usage=accounting.usage_so_far() if req.continuous_usage else None,
                        prompt_token_ids=choice_prompt[i] if ids_back else None))
            try:
                async for event in all_events():
                    accounting.record(event)
                    prompt_lps[event.index] += event.prompt_logprobs
                    if (not event.text and not event.logprobs and event.finish_reason is None
                            and not (ids_back and event.token_ids)):
                        continue
                    last = accounting.all_finished and not req.include_usage
                    spec = accounting.speculation().model() if last else None
                    if kind == "chat":
                        content, tool_calls, reason = event.text or None, None, event.finish_reason
                        if event.index in calls:  # tool calls are taken out of the text as they complete
                            choice = calls[event.index]
                            content, tool_calls = choice.feed(event.text, event.finish_reason is not None)
                            reason = choice.finish_reason(event.finish_reason)
                        chunk: BaseModel = s.ChatCompletionChunk(
                            id=rid, created=created, model=served, speculative_decoding=spec, choices=[
                                s.ChatChunkChoice(index=event.index, finish_reason=reason,
                                                  stop_reason=event.stop_reason,
                                                  delta=s.ChatDelta(content=content, tool_calls=tool_calls),
                                                  logprobs=formatter.chat(event.logprobs)
                                                  if logprobs is not None else None,
                                                  token_ids=event.token_ids if ids_back else None)])
                    else:
                        echoing = event.index in unechoed
                        unechoed.discard(event.index)
                        chunk = s.CompletionChunk(
                            id=rid, created=created, model=served, speculative_decoding=spec, choices=[
                                s.CompletionChoice(index=event.index,
                                                   text=(choice_echo[event.index] if echoing else "") + event.text,
                                                   finish_reason=event.finish_reason,
                                                   stop_reason=event.stop_reason,
                                                   logprobs=completion_logprobs(event.index, event.logprobs,
                                                                                offsets[event.index], echoing)
                                                   if logprobs is not None else None,
                                                   prompt_token_ids=choice_prompt[event.index]
                                                   if event.index in unsent_prompt_ids else None,
                                                   token_ids=event.token_ids if ids_back else None)])
                        unsent_prompt_ids.discard(event.index)
                    offsets[event.index] += len(event.text)
                    if req.continuous_usage:
                        chunk.usage = accounting.usage_so_far()
                    yield sse(chunk)
            except (grpc.RpcError, ApiError) as exc:
                error = from_grpc(exc) if isinstance(exc, grpc.RpcError) else exc
                yield sse(error.body())
                yield sse("[DONE]")
                return
            except Exception:  # the headers are sent: a bug ends the stream with an error event, not a reset
                logger.exception("unhandled error while streaming %s", rid)
                yield sse(internal_error().body())
                yield sse("[DONE]")
                return
        finish_metrics()
        if req.include_usage:
            cls = s.ChatCompletionChunk if kind == "chat" else s.CompletionChunk
            yield sse(cls(id=rid, created=created, model=served, choices=[], usage=accounting.usage(),
                          speculative_decoding=accounting.speculation().model()))
        yield sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
