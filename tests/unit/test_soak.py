"""The soak's judgement: how each way a request can end is classified, and which targets a report misses. A
soak that cannot fail proves nothing, so every failure class is produced here on purpose."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from services.soak.report import Memory, Percentiles, SoakReport, Targets, missed_targets, percentile
from services.soak.traffic import Outcome, StreamTimings, TrafficResult, TrafficSettings, one_request

OK_CHUNK = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
LAST_CHUNK = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def error(type_: str) -> dict:
    return {"error": {"message": "m", "type": type_, "param": None, "code": None}}


async def classify(kind: str, respond) -> Outcome:
    async def handler(request: httpx.Request) -> httpx.Response:
        return respond(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://soak") as client:
        outcome, _ = await one_request(client, kind, random.Random(0), TrafficSettings(request_timeout_s=5),
                                       StreamTimings())
    return outcome


def streamed(body: bytes, status: int = 200):
    return lambda request: httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})


def raises(exc: type[Exception]):
    def respond(request: httpx.Request) -> httpx.Response:
        raise exc("boom", request=request)

    return respond


@pytest.mark.parametrize(("kind", "respond", "expected"), [
    ("completion_stream", streamed(sse(OK_CHUNK, LAST_CHUNK, "[DONE]")), Outcome.OK),
    ("completion_stream", streamed(sse(OK_CHUNK, error("service_unavailable"), "[DONE]")), Outcome.UNAVAILABLE),
    ("completion_stream", streamed(sse(OK_CHUNK, error("server_error"), "[DONE]")), Outcome.SERVER_ERROR),
    ("completion_stream", streamed(sse(OK_CHUNK, LAST_CHUNK)), Outcome.BAD_RESPONSE),  # no [DONE]
    ("completion_stream", streamed(sse(OK_CHUNK, "[DONE]")), Outcome.BAD_RESPONSE),  # no finish_reason
    ("completion_stream", streamed(b"data: {not json\n\n"), Outcome.BAD_RESPONSE),
    ("cancel_stream", streamed(sse(OK_CHUNK, OK_CHUNK, OK_CHUNK, OK_CHUNK, LAST_CHUNK, "[DONE]")),
     Outcome.CANCELLED),
    ("completion", lambda r: httpx.Response(503, json=error("service_unavailable")), Outcome.UNAVAILABLE),
    ("completion", lambda r: httpx.Response(503, text="upstream gone"), Outcome.SERVER_ERROR),  # not OpenAI's
    ("completion", lambda r: httpx.Response(500, json=error("server_error")), Outcome.SERVER_ERROR),
    ("completion", lambda r: httpx.Response(200, json={"choices": [], "usage": {}}), Outcome.BAD_RESPONSE),
    ("bad_params", lambda r: httpx.Response(200, json={}), Outcome.WRONG_STATUS),
    ("bad_params", lambda r: httpx.Response(500, json=error("server_error")), Outcome.SERVER_ERROR),
    ("bad_json", lambda r: httpx.Response(400, json=error("invalid_request_error")), Outcome.CLEAN_4XX),
    ("bad_json", lambda r: httpx.Response(400, text="no"), Outcome.WRONG_STATUS),  # not an OpenAI error body
    ("chat", raises(httpx.ReadTimeout), Outcome.TIMEOUT),
    ("chat", raises(httpx.ConnectError), Outcome.CONNECTION_ERROR),
])
async def test_every_ending_is_classified(kind, respond, expected):
    assert await classify(kind, respond) == expected


def test_failures_are_everything_but_ok_cancelled_clean_4xx_and_503():
    assert {o for o in Outcome if not o.is_failure} == {Outcome.OK, Outcome.CANCELLED, Outcome.CLEAN_4XX,
                                                        Outcome.UNAVAILABLE}


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (50, 90, 99)
    assert percentile([3.0], 99) == 3.0
    assert Percentiles.of([]).count == 0


def report(outcomes: dict[Outcome, int], memory: list[Memory], running: int | None = 0) -> SoakReport:
    traffic = TrafficResult()
    for outcome, count in outcomes.items():
        for _ in range(count):
            traffic.record("chat", outcome, "detail")
    return SoakReport.build(traffic, memory, running, 0)


STEADY = [Memory("drafter", 1, 100, 1, 101), Memory("verifier", 2, 1000, 2, 1040),
          Memory("gateway", 3, 400, 3, 410)]


def test_a_clean_run_meets_every_target():
    clean = report({Outcome.OK: 50, Outcome.CLEAN_4XX: 5, Outcome.UNAVAILABLE: 2, Outcome.CANCELLED: 3}, STEADY)
    assert missed_targets(clean, Targets()) == []
    assert clean.failures == 0 and clean.requests == 60


@pytest.mark.parametrize(("outcomes", "memory", "running", "missed"), [
    ({Outcome.OK: 9, Outcome.SERVER_ERROR: 1}, STEADY, 0, "1 failed requests"),
    ({Outcome.OK: 9, Outcome.TIMEOUT: 1}, STEADY, 0, "1 failed requests"),
    ({Outcome.CLEAN_4XX: 9}, STEADY, 0, "no request succeeded"),
    ({Outcome.OK: 9}, STEADY, 2, "2 running"),
    ({Outcome.OK: 9}, STEADY, None, "None running"),
    ({Outcome.OK: 9}, [Memory("verifier", 2, 1000, 2, 1060)], 0, "verifier resident memory grew 6.0%"),
    ({Outcome.OK: 9}, [Memory("drafter", 1, 100, 7, 90)], 0, "drafter was restarted"),
    ({Outcome.OK: 9}, [Memory("gateway", 3, 400, None, None)], 0, "gateway was restarted"),
])
def test_each_missed_target_is_named(outcomes, memory, running, missed):
    sentences = missed_targets(report(outcomes, memory, running), Targets())
    assert len(sentences) == 1 and missed in sentences[0], sentences


def named(*events: dict) -> bytes:
    """A Responses API stream: each event on its `event:` line and numbered."""
    return b"".join(f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': i})}\n\n".encode()
                    for i, e in enumerate(events))


CREATED, DELTA = {"type": "response.created"}, {"type": "response.output_text.delta", "delta": "hi"}
RESPONSE = {"object": "response", "status": "completed", "output": [{"type": "message"}],
            "usage": {"output_tokens": 3}}


def chat(message: dict, finish: str) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": {"completion_tokens": 3}}


def call(name: str, arguments: str) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}]}


@pytest.mark.parametrize(("kind", "respond", "expected"), [
    ("responses_stream", streamed(named(CREATED, DELTA, {"type": "response.completed"})), Outcome.OK),
    ("responses_stream", streamed(named(CREATED, DELTA, {"type": "response.incomplete"})), Outcome.OK),
    ("responses_stream", streamed(named(CREATED, DELTA)), Outcome.BAD_RESPONSE),  # no last event
    ("responses_stream", streamed(named(CREATED, {"type": "error", "code": "unavailable"})), Outcome.UNAVAILABLE),
    ("responses_stream", streamed(named(CREATED, {"type": "error", "code": "internal_error"})),
     Outcome.SERVER_ERROR),
    ("responses_stream", streamed(named(CREATED) + named(DELTA)), Outcome.BAD_RESPONSE),  # numbered twice from 0
    ("responses_stream", streamed(sse(CREATED)), Outcome.BAD_RESPONSE),  # not named
    ("responses", lambda r: httpx.Response(200, json=RESPONSE), Outcome.OK),
    ("responses", lambda r: httpx.Response(200, json={**RESPONSE, "status": "failed"}), Outcome.BAD_RESPONSE),
    ("responses", lambda r: httpx.Response(200, json={**RESPONSE, "output": []}), Outcome.BAD_RESPONSE),
    ("chat_json", lambda r: httpx.Response(200, json=chat({"content": '{"answer": "x"}'}, "stop")), Outcome.OK),
    ("chat_json", lambda r: httpx.Response(200, json=chat({"content": '{"answer": 1}'}, "stop")),
     Outcome.BAD_RESPONSE),
    ("chat_json", lambda r: httpx.Response(200, json=chat({"content": '["answer"]'}, "stop")), Outcome.BAD_RESPONSE),
    ("chat_json", lambda r: httpx.Response(200, json=chat({"content": '{"ans'}, "stop")), Outcome.BAD_RESPONSE),
    ("chat_json", lambda r: httpx.Response(200, json=chat({"content": '{"ans'}, "length")), Outcome.OK),  # cut
    ("chat_tool", lambda r: httpx.Response(200, json=chat(call("get_weather", '{"city": "Paris"}'), "tool_calls")),
     Outcome.OK),
    ("chat_tool", lambda r: httpx.Response(200, json=chat({"content": "It is sunny."}, "stop")),
     Outcome.BAD_RESPONSE),
    ("chat_tool", lambda r: httpx.Response(200, json=chat(call("get_weather", '{"city": '), "tool_calls")),
     Outcome.BAD_RESPONSE),
    ("chat_tool", lambda r: httpx.Response(200, json=chat(call("other", "{}"), "tool_calls")), Outcome.BAD_RESPONSE),
])
async def test_the_responses_api_a_schema_and_a_forced_call_are_classified(kind, respond, expected):
    assert await classify(kind, respond) == expected


def test_the_soak_fills_suffix_decodings_response_cache_in_its_warm_up():
    """Suffix decoding's global tree grows by design up to its cap (10,000 responses): the soak serves with a cap
    its warm-up reaches, so that the drafter's memory after the warm-up measures leaks, not the cache filling."""
    from services.soak.main import SOAK_CACHED_RESPONSES, soak_speculation

    capped = json.loads(soak_speculation('{"method": "suffix", "num_speculative_tokens": 3}'))
    assert capped == {"method": "suffix", "num_speculative_tokens": 3,
                      "suffix_decoding_max_cached_requests": SOAK_CACHED_RESPONSES}
    given = '{"method": "suffix", "suffix_decoding_max_cached_requests": 9}'
    assert json.loads(soak_speculation(given))["suffix_decoding_max_cached_requests"] == 9
    assert json.loads(soak_speculation('{"method": "ngram"}')) == {"method": "ngram"}
    assert json.loads(soak_speculation(None))["method"] in ("suffix", "ngram")  # serve's default, on this machine
