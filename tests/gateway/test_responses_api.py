"""POST /v1/responses (OpenAI's Responses API) through the official openai SDK against the gateway served by
uvicorn and a scripted verifier: whole and streamed output, the SDK's stream helper and parse, function tools with
a follow-up turn, logprobs, max_output_tokens, what the request becomes on the wire, and 400s that name each
field this server does not implement."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.gateway.test_tool_calls import CALL, WEATHER

MODEL = "tiny-test"
REPLY = "Hello, wörld! 你好. The end."
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool


@pytest.fixture
def sdk(served):
    return openai.OpenAI(base_url=served() + "/v1", api_key="unused", max_retries=0)


def test_whole_response(sdk, verifier):
    r = sdk.responses.create(model=MODEL, input="hi", instructions="Be brief.", temperature=0.5,
                             metadata={"team": "a"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == REPLY and r.incomplete_details is None and r.model == MODEL
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert r.usage.output_tokens == len(REPLY.encode()) + 1 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.temperature == 0.5 and r.metadata == {"team": "a"}
    assert r.store is False and r.tools == [] and r.tool_choice == "auto"
    sent = verifier.requests[-1]
    prompt = bytes(t for t in sent.prompt_token_ids if t < 256).decode()
    assert prompt.index("Be brief.") < prompt.index("hi"), "instructions are the first (system) message"
    assert sent.sampling.temperature == pytest.approx(0.5)


def test_max_output_tokens_makes_an_incomplete_response(sdk):
    r = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == REPLY[:5] and r.output[0].status == "incomplete"


def test_streamed_events_build_the_whole_response(sdk):
    whole = sdk.responses.create(model=MODEL, input="hi")
    events = list(sdk.responses.create(model=MODEL, input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    with sdk.responses.stream(model=MODEL, input="hi") as stream:  # the SDK's helper checks the events' order
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == text == REPLY


def test_a_stream_names_each_event_on_its_event_line(served):
    import httpx

    with httpx.stream("POST", served() + "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True},
                      timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    named = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert named == [d["type"] for d in data] and named[-1] == "response.completed"
    assert "[DONE]" not in "".join(lines), "a Responses stream ends with its last event, as OpenAI's"


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(sdk, served, verifier):
    """The verifier lost after the first tokens (UNAVAILABLE, never retried then): the stream says so as OpenAI's
    does, an `error` event and `response.failed` holding the error and what was written, both named on their
    `event:` lines; the SDK hands both to its user, and its stream helper ends on the failed response."""
    import httpx

    verifier.unavailable_after_first = True
    events = list(sdk.responses.create(model=MODEL, input="hi", max_output_tokens=100, stream=True))
    error, failed = events[-2:]
    assert error.type == "error" and error.code == "unavailable" and error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error" and failed.response.error.message == error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    written = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert written and REPLY.startswith(written) and failed.response.output[0].content[0].text == written
    with httpx.stream("POST", served() + "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True},
                      timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-4] == "event: error" and json.loads(lines[-3][6:])["type"] == "error"
    assert lines[-2] == "event: response.failed" and json.loads(lines[-1][6:])["type"] == "response.failed"


def test_parse_holds_the_output_to_the_schema(sdk, verifier):
    class City(BaseModel):
        name: str

    verifier.reply = '{"name": "Paris"}'
    parsed = sdk.responses.parse(model=MODEL, input="a city", text_format=City)
    assert parsed.output_parsed == City(name="Paris")
    constraint = verifier.requests[-1].sampling.structured_output
    assert json.loads(constraint.json_schema)["properties"] == {"name": {"title": "Name", "type": "string"}}


def test_function_calls_whole_streamed_and_answered(sdk, verifier):
    verifier.reply, verifier.tokens_per_step, verifier.max_model_len = "Checking." + CALL, 4, 4096
    r = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[FUNCTION])
    message, call = r.output
    assert message.content[0].text == "Checking." and r.status == "completed"
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")

    events = list(sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[FUNCTION], stream=True))
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text == "Checking."
    [arguments] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(arguments.arguments) == {"city": "Paris"} and arguments.output_index == 1

    verifier.reply = "It is 18 C."
    earlier = [item.model_dump(exclude_none=True) for item in r.output]  # the output items, sent back as input
    turn = [{"role": "user", "content": "Weather in Paris?"}, *earlier,
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}]
    answer = sdk.responses.create(model=MODEL, input=turn, tools=[FUNCTION])
    assert answer.output_text == "It is 18 C."
    prompt = bytes(t for t in verifier.requests[-1].prompt_token_ids if t < 256).decode()
    assert '"temp_c": 18' in prompt and "get_weather" in prompt, "the call and its result reach the template"


def test_tool_choice_none_offers_no_tool(sdk, verifier):
    verifier.max_model_len = 4096
    sdk.responses.create(model=MODEL, input="hi", tools=[FUNCTION], tool_choice="none")
    prompt = bytes(t for t in verifier.requests[-1].prompt_token_ids if t < 256).decode()
    assert "get_weather" not in prompt


def test_logprobs_when_included(sdk):
    r = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=4, top_logprobs=1,
                             include=["message.output_text.logprobs"])
    logprobs = r.output[0].content[0].logprobs
    assert [entry.token for entry in logprobs] == ["H", "e", "l", "l"] and len(logprobs[0].top_logprobs) == 1
    plain = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs is None


def test_speculative_config_reaches_the_verifier(sdk, verifier):
    sdk.responses.create(model=MODEL, input="hi", extra_body={"speculative_config": {"method": "none"}})
    assert verifier.requests[-1].speculation.method == "none"


@pytest.mark.parametrize(("fields", "named"), [  # named: a regular expression the error message matches
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, r"tools\[0\]"),
    ({"include": ["reasoning.encrypted_content"]}, "reasoning.encrypted_content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, r"input\[0\]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, r"input\[0\]\.arguments"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, r"input\[0\] is not an object; input is a string or a list of items"),
    ({"input": {"role": "user", "content": "hi"}}, "input is a string or a list of items"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100_000}, "maximum context length .* Reduce the prompt or max_output_tokens"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options is only allowed when stream is true"),
    ({"text": {"verbosity": "low"}}, "verbosity"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"model": "other"}, "other"),
])
def test_what_is_not_implemented_is_a_400_naming_it(sdk, fields, named):
    body = {"model": MODEL, "input": "hi", **fields}
    error = openai.NotFoundError if fields.get("model") == "other" else openai.BadRequestError
    with pytest.raises(error, match=named):
        sdk.responses.create(**{k: v for k, v in body.items() if k in ("model", "input")},
                             extra_body={k: v for k, v in body.items() if k not in ("model", "input")})


def test_a_limit_over_the_context_names_the_field_that_set_it(sdk):
    with pytest.raises(openai.BadRequestError, match="Reduce the prompt or max_completion_tokens") as refused:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_completion_tokens=100_000)
    assert refused.value.body["param"] == "max_completion_tokens"


def test_store_false_and_nulls_are_accepted(sdk):
    r = sdk.responses.create(model=MODEL, input="hi", store=False,
                             extra_body={"previous_response_id": None, "stream": None, "reasoning": {"effort": None}})
    assert r.output_text == REPLY


def test_tokens_are_what_the_chat_route_sends(sdk, verifier):
    """The same conversation, asked through both routes, reaches the verifier as the same request."""
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "S"},
                                                      {"role": "user", "content": "hi"}], max_tokens=7)
    chat = verifier.requests[-1]
    sdk.responses.create(model=MODEL, instructions="S", input="hi", max_output_tokens=7)
    response = verifier.requests[-1]
    assert list(response.prompt_token_ids) == list(chat.prompt_token_ids)
    assert response.sampling == chat.sampling
