"""Saturating traffic against the gateway, with every request's outcome classified.

Workers (more than the verifier has KV slots, so requests queue) loop over a seeded mix of the requests real
clients send: streaming and non-streaming, chat, completions and the Responses API, n > 1, a JSON schema and a
forced tool call (grammars under speculation), streams the client leaves mid-way, and invalid ones (bad JSON, bad
parameters, an unknown model) that must get a clean 4xx. Each request ends in one `Outcome`; anything not
expected (a 5xx other than 503, a wrong status for an invalid request, a stream that ends without its last
message or with an error other than "unavailable", a malformed body or one that breaks its schema or tool, a
timeout, a refused connection) is a failure, with its first examples kept for the report.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

from services.modeling.registry import DEFAULT_MODEL

MODEL = DEFAULT_MODEL  # the served model name the soak traffic sends
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.quantity\n"
    "    return result\n"
)
EDIT = f"Rename the function total to order_total and return the whole code:\n\n{CODE}"
PROMPTS = (
    EDIT,
    "Write a Python function that reverses a string.",
    "Name three rivers and one fact about each.",
    "Explain in two sentences what a hash map is.",
    f"Add type hints to this code and return it:\n\n{CODE}",
)


class Outcome(StrEnum):
    OK = "ok"
    CANCELLED = "cancelled"  # the client left mid-stream on purpose, after a 200 and some chunks
    CLEAN_4XX = "clean_4xx"  # an invalid request refused with the expected status and an OpenAI error body
    UNAVAILABLE = "503"  # a clean 503 (before the stream) or an SSE error of type service_unavailable
    SERVER_ERROR = "5xx"
    WRONG_STATUS = "wrong_status"
    BAD_RESPONSE = "bad_response"
    TIMEOUT = "timeout"
    CONNECTION_ERROR = "connection_error"

    @property
    def is_failure(self) -> bool:
        return self not in (Outcome.OK, Outcome.CANCELLED, Outcome.CLEAN_4XX, Outcome.UNAVAILABLE)


@dataclass(frozen=True)
class TrafficSettings:
    duration_s: float = 600.0
    max_requests: int = 100_000
    concurrency: int = 16
    max_tokens: int = 32
    request_timeout_s: float = 120.0
    seed: int = 0
    model: str = MODEL


# kind -> weight in the mix
MIX = {
    "chat_stream": 25, "completion_stream": 10, "completion": 10, "chat": 10, "chat_n2": 8,
    "responses": 5, "responses_stream": 5, "chat_json": 4, "chat_tool": 4,
    "cancel_stream": 9, "bad_json": 5, "bad_params": 9,
}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                 "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
UNAVAILABLE_CODES = ("unavailable", "resource_exhausted")  # a Responses stream's error event of a 503


@dataclass(frozen=True)
class Invalid:
    """An invalid request and the status it must get."""

    body: bytes
    status: int
    path: str = "/v1/chat/completions"


def invalid_requests(model: str) -> list[Invalid]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return [
        Invalid(b'{"model": "' + model.encode() + b'", "messages": [', 400),
        Invalid(b"\xff\xfe not utf-8", 400),
        Invalid(json.dumps({**chat, "temperature": -1}).encode(), 400),
        Invalid(json.dumps({**chat, "top_p": 2}).encode(), 400),
        Invalid(json.dumps({**chat, "n": 0}).encode(), 400),
        Invalid(json.dumps({**chat, "messages": "not a list"}).encode(), 400),
        Invalid(json.dumps({**chat, "model": "no-such-model"}).encode(), 404),
        Invalid(json.dumps({"model": model, "prompt": "x", "max_tokens": -3}).encode(), 400, "/v1/completions"),
    ]


@dataclass
class StreamTimings:
    """Per streaming request: time to the first content chunk, and the gaps between content chunks."""

    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


@dataclass
class TrafficResult:
    outcomes: Counter = field(default_factory=Counter)  # Outcome -> count
    by_kind: Counter = field(default_factory=Counter)  # (kind, Outcome) -> count
    timings: StreamTimings = field(default_factory=StreamTimings)
    failure_examples: list[str] = field(default_factory=list)
    started: int = 0
    elapsed_s: float = 0.0

    def record(self, kind: str, outcome: Outcome, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        self.by_kind[(kind, outcome)] += 1
        if outcome.is_failure and len(self.failure_examples) < 20:
            self.failure_examples.append(f"{kind}: {outcome}: {detail[:300]}")


def _body(kind: str, rng: random.Random, settings: TrafficSettings) -> tuple[str, dict]:
    prompt = rng.choice(PROMPTS)
    messages = [{"role": "user", "content": prompt}]
    common = {"model": settings.model, "max_tokens": settings.max_tokens,
              "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(1 << 30)}
    if kind == "chat_stream":
        return "/v1/chat/completions", {**common, "messages": messages, "stream": True,
                                        "stream_options": {"include_usage": True}}
    if kind == "completion_stream":
        return "/v1/completions", {**common, "prompt": prompt, "stream": True}
    if kind == "completion":
        return "/v1/completions", {**common, "prompt": prompt}
    if kind == "chat":
        return "/v1/chat/completions", {**common, "messages": messages}
    if kind == "chat_n2":
        return "/v1/chat/completions", {**common, "messages": messages, "n": 2, "temperature": 0.8}
    if kind == "cancel_stream":
        return "/v1/completions", {**common, "prompt": prompt, "stream": True, "max_tokens": 200,
                                   "ignore_eos": True}
    if kind in ("responses", "responses_stream"):
        return "/v1/responses", {"model": settings.model, "input": prompt, "max_output_tokens": settings.max_tokens,
                                 "temperature": common["temperature"], "stream": kind == "responses_stream"}
    if kind == "chat_json":
        return "/v1/chat/completions", {**common, "messages": messages, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}}
    if kind == "chat_tool":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                                        "tools": [WEATHER_TOOL], "tool_choice": "required"}
    raise ValueError(kind)


def _error_type(body: bytes) -> str | None:
    """The OpenAI error body's `error.type`, or None when the body is not one."""
    try:
        error = json.loads(body)["error"]
        return error["type"] if isinstance(error.get("message"), str) else None
    except (ValueError, KeyError, TypeError):
        return None


def _status_outcome(status: int, body: bytes) -> tuple[Outcome, str]:
    """The outcome of a non-200 answer to a valid request."""
    if status == 503 and _error_type(body) is not None:
        return Outcome.UNAVAILABLE, ""
    if status >= 500:
        return Outcome.SERVER_ERROR, f"{status} {body[:200]!r}"
    return Outcome.WRONG_STATUS, f"{status} {body[:200]!r}"


async def _plain(client: httpx.AsyncClient, path: str, body: dict, kind: str) -> tuple[Outcome, str]:
    response = await client.post(path, json=body)
    if response.status_code != 200:
        return _status_outcome(response.status_code, response.content)
    try:
        data = response.json()
        problem = _response_problem(data) if kind == "responses" else _choices_problem(data, body, kind)
    except (ValueError, KeyError, TypeError, IndexError) as error:
        return Outcome.BAD_RESPONSE, f"{error!r}: {response.content[:200]!r}"
    return (Outcome.BAD_RESPONSE, problem) if problem else (Outcome.OK, "")


def _choices_problem(data: dict, body: dict, kind: str) -> str:
    """What is wrong with a chat or completion body ("" if nothing): the choices, their finish reasons, and for a
    JSON schema or a forced tool call, output that breaks it (unless max_tokens cut it)."""
    n = body.get("n", 1)
    finished = [c["finish_reason"] for c in data["choices"]]
    if len(finished) != n or None in finished or data["usage"]["completion_tokens"] < 0:
        return f"choices={len(finished)} finish={finished} usage={data['usage']}"
    message = data["choices"][0].get("message") or {}
    if kind == "chat_json" and finished[0] == "stop":
        parsed = json.loads(message["content"])  # a ValueError: not JSON at all
        if not isinstance(parsed, dict) or not isinstance(parsed.get("answer"), str):
            return f"breaks its schema: {message['content'][:200]!r}"
    if kind == "chat_tool" and finished[0] != "length":
        calls = message.get("tool_calls") or []
        if finished[0] != "tool_calls" or not calls or calls[0]["function"]["name"] != "get_weather":
            return f"no forced call: finish={finished[0]} message={json.dumps(message)[:200]}"
        json.loads(calls[0]["function"]["arguments"])  # a ValueError: arguments that are not JSON
    return ""


def _response_problem(data: dict) -> str:
    """What is wrong with a Responses API body ("" if nothing)."""
    if data["object"] != "response" or data["status"] not in ("completed", "incomplete") or not data["output"]:
        return f"status={data.get('status')} output={data.get('output')!r:.200}"
    if data["usage"]["output_tokens"] < 0:
        return f"usage={data['usage']}"
    return ""


def _content(event: dict) -> bool:
    """Whether an SSE chunk carries generated text."""
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _finished(event: dict) -> bool:
    return any(choice.get("finish_reason") for choice in event.get("choices") or ())


async def _stream(client: httpx.AsyncClient, path: str, body: dict, timings: StreamTimings,
                  leave_after: int | None) -> tuple[Outcome, str]:
    """One streaming request; `leave_after`: close the connection after that many chunks (a client going
    away)."""
    sent = time.perf_counter()
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return _status_outcome(response.status_code, await response.aread())
        last_content, first, chunks, finished = None, None, 0, False
        async for line in response.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                return Outcome.BAD_RESPONSE, f"not an SSE data line: {line[:200]!r}"
            data = line[len("data: "):]
            if data == "[DONE]":
                if not finished:
                    return Outcome.BAD_RESPONSE, "[DONE] before any finish_reason"
                if first is not None and leave_after is None:  # an immediate EOS has no first token
                    timings.ttft_s.append(first)
                return Outcome.OK, ""
            try:
                event = json.loads(data)
            except ValueError:
                return Outcome.BAD_RESPONSE, f"not JSON: {data[:200]!r}"
            if "error" in event:
                kind = (event["error"] or {}).get("type")
                return (Outcome.UNAVAILABLE, "") if kind == "service_unavailable" else (
                    Outcome.SERVER_ERROR, f"SSE error {data[:200]}")
            chunks += 1
            finished = finished or _finished(event)
            if _content(event):
                now = time.perf_counter()
                if first is None:
                    first = now - sent
                elif leave_after is None:
                    timings.itl_s.append(now - last_content)
                last_content = now
            if leave_after is not None and chunks >= leave_after:
                return Outcome.CANCELLED, ""
        return Outcome.BAD_RESPONSE, "the stream ended without [DONE]"


async def _invalid(client: httpx.AsyncClient, invalid: Invalid) -> tuple[Outcome, str]:
    response = await client.post(invalid.path, content=invalid.body, headers={"Content-Type": "application/json"})
    if response.status_code == invalid.status and _error_type(response.content) is not None:
        return Outcome.CLEAN_4XX, ""
    if response.status_code >= 500 and response.status_code != 503:
        return Outcome.SERVER_ERROR, f"{response.status_code} for {invalid.body[:80]!r}"
    return Outcome.WRONG_STATUS, f"{response.status_code} (want {invalid.status}) for {invalid.body[:80]!r}"


async def _responses_stream(client: httpx.AsyncClient, body: dict) -> tuple[Outcome, str]:
    """A streamed Responses API request: named events whose sequence numbers count up, ending with
    response.completed or response.incomplete (an `error` event of a 503 is a clean unavailable)."""
    async with client.stream("POST", "/v1/responses", json=body) as response:
        if response.status_code != 200:
            return _status_outcome(response.status_code, await response.aread())
        named, sequence = None, 0
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                named = line[len("event: "):]
                continue
            if not line:
                continue
            if not line.startswith("data: "):
                return Outcome.BAD_RESPONSE, f"not an SSE line: {line[:200]!r}"
            try:
                event = json.loads(line[len("data: "):])
            except ValueError:
                return Outcome.BAD_RESPONSE, f"not JSON: {line[:200]!r}"
            if event.get("type") != named or event.get("sequence_number") != sequence:
                return Outcome.BAD_RESPONSE, f"event {named!r} #{sequence}: {line[:200]!r}"
            sequence += 1
            if named == "error":
                return ((Outcome.UNAVAILABLE, "") if event.get("code") in UNAVAILABLE_CODES
                        else (Outcome.SERVER_ERROR, f"error event {line[:200]}"))
            if named in ("response.completed", "response.incomplete"):
                return Outcome.OK, ""
        return Outcome.BAD_RESPONSE, "the stream ended without response.completed"


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, settings: TrafficSettings,
                      timings: StreamTimings) -> tuple[Outcome, str]:
    """Send one request of `kind`; every way it can end becomes an Outcome (never an exception)."""
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            if kind == "bad_json":
                return await _invalid(client, invalid_requests(settings.model)[rng.randrange(2)])
            if kind == "bad_params":
                return await _invalid(client, rng.choice(invalid_requests(settings.model)[2:]))
            path, body = _body(kind, rng, settings)
            if kind == "responses_stream":
                return await _responses_stream(client, body)
            if body.get("stream"):
                leave = rng.randint(1, 4) if kind == "cancel_stream" else None
                return await _stream(client, path, body, timings, leave)
            return await _plain(client, path, body, kind)
    except TimeoutError:
        return Outcome.TIMEOUT, f"no answer within {settings.request_timeout_s:.0f} s"
    except httpx.TimeoutException as error:
        return Outcome.TIMEOUT, repr(error)
    except httpx.TransportError as error:
        return Outcome.CONNECTION_ERROR, repr(error)


async def drive(base_url: str, settings: TrafficSettings) -> TrafficResult:
    """Keep `settings.concurrency` requests in flight until the duration or the request budget is spent; the
    requests in flight then finish (bounded by their timeout)."""
    result = TrafficResult()
    kinds, weights = list(MIX), list(MIX.values())
    deadline = time.monotonic() + settings.duration_s
    started = time.monotonic()
    timeout = httpx.Timeout(settings.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=settings.concurrency * 2, max_keepalive_connections=settings.concurrency)

    async def worker(index: int) -> None:
        rng = random.Random(settings.seed * 1000 + index)
        while time.monotonic() < deadline and result.started < settings.max_requests:
            result.started += 1
            kind = rng.choices(kinds, weights)[0]
            outcome, detail = await one_request(client, kind, rng, settings, result.timings)
            result.record(kind, outcome, detail)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(worker(i) for i in range(settings.concurrency)))
    result.elapsed_s = time.monotonic() - started
    return result
