"""The whole stack as real processes (drafter, verifier with SmolLM2-135M, gateway) driven by the real OpenAI SDK
and by raw HTTP, as users drive it."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.verifier.draft_breaker import OPEN_AFTER
from tests.e2e.requests import CODE, EDIT, MODEL, NO_SPEC, at_once, in_background, wait_until_speculation_accepts

pytestmark = pytest.mark.slow


@pytest.fixture()
def stack(shared_stack):
    return shared_stack


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_and_chat_sync(client):
    completion, chat = at_once(
        lambda: client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0),
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0))
    assert completion.choices[0].text and completion.usage.completion_tokens <= 8
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.prompt_tokens > 0 and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_streaming_both_endpoints(client):
    messages = [{"role": "user", "content": EDIT}]
    chunks, full, pieces, whole = at_once(
        lambda: list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0),
        lambda: list(client.completions.create(model=MODEL, prompt=CODE, max_tokens=20, temperature=0, stream=True)),
        lambda: client.completions.create(model=MODEL, prompt=CODE, max_tokens=20, temperature=0))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text


def test_async_client(stack):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        results = await asyncio.gather(*(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=10, temperature=0
            )
            for i in range(3)
        ))
        await client.close()
        return results

    for result in asyncio.run(run()):
        assert result.choices[0].message.content


def test_greedy_equality_with_and_without_speculation(client):
    messages = [{"role": "user", "content": EDIT}]
    kwargs = {"model": MODEL, "prompt": EDIT, "max_tokens": 40, "temperature": 0, "n": 2, "stop": ["quantity"]}
    spec, plain, a, b = at_once(
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                               extra_body=NO_SPEC),
        lambda: client.completions.create(**kwargs),  # n > 1 and stop strings
        lambda: client.completions.create(**kwargs, extra_body=NO_SPEC))
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.model_extra["speculative_decoding"]["num_accepted_tokens"] > 0
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert all("quantity" not in c.text for c in a.choices)


def test_the_responses_api_answers_what_chat_answers_with_speculation_on_and_off(client):
    """OpenAI's Responses API (POST /v1/responses) is the chat pipeline in other shapes: the same conversation at
    temperature 0 gives the chat's text, whole and streamed, with speculation and without."""
    chat, whole, streamed, plain = at_once(
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be exact."},
                                                                      {"role": "user", "content": EDIT}],
                                               max_tokens=40, temperature=0),
        lambda: client.responses.create(model=MODEL, instructions="Be exact.", input=EDIT, max_output_tokens=40,
                                        temperature=0),
        lambda: list(client.responses.create(model=MODEL, instructions="Be exact.", input=EDIT,
                                             max_output_tokens=40, temperature=0, stream=True)),
        lambda: client.responses.create(model=MODEL, instructions="Be exact.", input=EDIT, max_output_tokens=40,
                                        temperature=0, extra_body=NO_SPEC))
    text = chat.choices[0].message.content
    assert whole.output_text == plain.output_text == text
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == text
    assert streamed[-1].response.output_text == text
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.model_extra["speculative_decoding"]["num_accepted_tokens"] > 0


def test_a_predicted_output_is_drafted_from_and_the_reply_is_unchanged(client):
    """OpenAI's predicted outputs on the real model: with the code it edits as the prediction (greedy, sampled with
    a seed), the reply is the one without speculation, and the prediction's tokens are accepted; a wrong prediction
    changes nothing either."""
    messages = [{"role": "user", "content": EDIT}]
    edited = CODE.replace("def total", "def order_total")
    plain, predicted, wrong, seeded, seeded_predicted = at_once(
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                               extra_body=NO_SPEC),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                               prediction={"type": "content", "content": edited}),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                               prediction={"type": "content", "content": "Nothing like it. " * 9}),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.8,
                                               seed=7, extra_body=NO_SPEC),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.8,
                                               seed=7, prediction={"type": "content", "content": edited}))
    text = plain.choices[0].message.content
    assert predicted.choices[0].message.content == wrong.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0, details
    assert predicted.model_extra["speculative_decoding"]["method"] == "prediction"
    assert seeded_predicted.choices[0].message.content == seeded.choices[0].message.content


def test_raw_http_like_curl(stack):
    response = httpx.post(
        f"{stack.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200 and response.json()["object"] == "text_completion"
    with httpx.stream(
        "POST", f"{stack.base_url}/v1/chat/completions", timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True},
    ) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    json.loads(lines[0][len("data: "):])
    bad = httpx.post(f"{stack.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1}, timeout=10)
    assert bad.status_code == 400 and set(bad.json()["error"]) >= {"message", "type", "param", "code"}
    assert httpx.post(f"{stack.base_url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10).status_code == 404


def mapped_libraries(pid: int) -> set[str]:
    """The file names of the shared libraries a running process has mapped (Linux /proc)."""
    with open(f"/proc/{pid}/maps") as maps:
        return {Path(line.split()[-1]).name for line in maps if ".so" in line}


def test_the_gateway_process_runs_without_torch_beside_a_verifier_that_runs_it(stack, client):
    """One virtualenv holds the whole stack here, as `make run` makes it; the gateway still runs as its image runs
    it, without torch (services/gateway/torch_free.py), after serving a chat and a completion."""
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    is_torch = re.compile(r"^libtorch(_cpu|_python)?\.so")
    assert not any(is_torch.match(name) for name in mapped_libraries(stack.processes["gateway"].pid))
    assert any(is_torch.match(name) for name in mapped_libraries(stack.processes["verifier"].pid))


def test_client_disconnect_frees_the_slot(stack):
    with httpx.stream(
        "POST", f"{stack.base_url}/v1/completions", timeout=60,
        json={"model": MODEL, "prompt": CODE, "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True},
    ) as stream:
        for i, _ in enumerate(stream.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if stack.verifier_metric("specserve_num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert stack.verifier_metric("specserve_num_requests_running") == 0


def test_twenty_concurrent_streams(stack):
    async def one(client: openai.AsyncOpenAI, i: int):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write {i} words about rivers."}], max_tokens=16,
            temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
        )
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return finish, usage

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        results = await asyncio.gather(*(one(client, i) for i in range(20)))
        await client.close()
        return results

    for finish, usage in asyncio.run(run()):
        assert finish in ("stop", "length")
        assert usage is not None and 1 <= usage.completion_tokens <= 16
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_drafter_death_costs_speed_not_correctness(stack, client):
    messages = [{"role": "user", "content": EDIT}]
    fallbacks_before = stack.verifier_metric("specserve_spec_decode_num_fallbacks_total")
    reference = in_background(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=80,
                              temperature=0, extra_body=NO_SPEC)  # beside the stream, in the same steps
    received: list[str] = []

    def consume():
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 30
    while len(received) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    stack.stop_drafter()  # mid-stream
    try:
        reader.join(timeout=120)
        assert "".join(received) == reference.result(timeout=120).choices[0].message.content
        assert stack.verifier_metric("specserve_spec_decode_num_fallbacks_total") > fallbacks_before
    finally:
        stack.start_drafter()  # the verifier reconnects and re-opens sequences (the stack is shared: always)
    assert wait_until_speculation_accepts(client, messages) > 0
    # the restarted drafter's own /metrics saw the steps it answered
    assert stack.drafter_metric("specserve_drafter_steps_total") > 0
    assert stack.drafter_metric("specserve_drafter_proposed_tokens_total") > 0


def drafter_state(stack) -> str:
    return httpx.get(f"{stack.base_url}/health", timeout=5).json()["drafters"][0]["state"]


def test_a_hung_drafter_is_not_waited_for_and_drafts_again_when_it_resumes(stack, client):
    """SIGSTOP: the link stays up but nothing answers. After a few missed deadlines the verifier's breaker stops
    waiting (the late calls stop counting up while requests keep running), /health and the metric say degraded,
    the output is unchanged; after SIGCONT a probe re-admits the drafter and its drafts are accepted again."""
    messages = [{"role": "user", "content": EDIT}]
    tokens = 24  # enough steps for the breaker to open, then to skip the drafter
    drafter = stack.processes["drafter"]
    late_before = stack.verifier_metric("specserve_spec_decode_num_late_proposals_total")
    drafter.send_signal(signal.SIGSTOP)
    try:
        reply = [lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=tokens,
                                                        temperature=0).choices[0].message.content] * 3
        reference, *outputs = at_once(lambda: client.chat.completions.create(  # needs no drafter
            model=MODEL, messages=messages, max_tokens=tokens, temperature=0, extra_body=NO_SPEC,
        ).choices[0].message.content, *reply)
        assert outputs == [reference] * 3
        assert drafter_state(stack) == "degraded"
        assert stack.verifier_metric("specserve_drafter_degraded") == 1
        late_during = stack.verifier_metric("specserve_spec_decode_num_late_proposals_total") - late_before
        # more requests while it is still stopped: none of their steps waits for it
        again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=tokens, temperature=0)
        assert again.choices[0].message.content == reference
        assert again.model_extra["speculative_decoding"]["num_draft_tokens"] == 0
        assert stack.verifier_metric("specserve_spec_decode_num_late_proposals_total") - late_before == late_during
        assert late_during <= OPEN_AFTER  # then the breaker opened
    finally:
        drafter.send_signal(signal.SIGCONT)
    assert wait_until_speculation_accepts(client, messages) > 0
    assert drafter_state(stack) == "serving"
    assert stack.verifier_metric("specserve_drafter_degraded") == 0
    assert stack.verifier_metric("specserve_drafter_degraded_episodes_total") >= 1


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                       "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
JSON_PROMPTS = ["Describe a fictional person as JSON with name, age and hobbies.",
                "Return JSON for Ada Lovelace: name, age at death, hobbies.",
                "Give me a JSON record of a chess player (name, age, hobbies)."]


def test_structured_output_parses_and_validates_with_speculation_on_and_off(client):
    """Greedy: the same text with ngram speculation and without; every output parses and fits the schema."""
    import jsonschema

    def person(prompt: str, extra: dict):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=120, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            extra_body=extra)

    sampled, obj, choice, regex, *replies = at_once(  # grammar rows of several requests share every step
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": JSON_PROMPTS[0]}], max_tokens=200, temperature=0.8,
            seed=3, extra_body={"guided_json": PERSON}),
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing '
                                                              'else.'}],
            max_tokens=40, temperature=0, response_format={"type": "json_object"}),
        lambda: client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                          extra_body={"guided_choice": ["yes", "no"]}),
        lambda: client.completions.create(model=MODEL, prompt="The year it happened:", max_tokens=8, temperature=0,
                                          extra_body={"structured_outputs": {"regex": "1[89][0-9]{2}"},
                                                      "guided_decoding_backend": "guidance"}),  # vLLM's fields
        *(person(prompt, extra) for prompt in JSON_PROMPTS for extra in ({}, NO_SPEC)))
    drafted = 0
    for speculative, plain in zip(replies[::2], replies[1::2], strict=True):
        for reply in (speculative, plain):
            jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
            assert reply.choices[0].finish_reason == "stop"  # the grammar completed, nothing cut
            drafted += reply.model_extra["speculative_decoding"]["num_draft_tokens"]
        assert speculative.choices[0].message.content == plain.choices[0].message.content
    if sampled.choices[0].finish_reason == "stop":  # sampled whitespace may run long; what is complete parses
        jsonschema.validate(json.loads(sampled.choices[0].message.content), PERSON)
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    assert choice.choices[0].text in ("yes", "no")
    assert re.fullmatch("1[89][0-9]{2}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    print(f"draft tokens verified under the schema: {drafted}")


def test_vllm_token_rules_keep_greedy_output_the_same_with_speculation(stack, client):
    """bad_words, min_tokens and allowed_token_ids mask every verified position (drafts included): greedy output
    is the same with n-gram speculation on and off, the banned sequences never appear in the output's ids, and
    the ids come back (return_token_ids). The edit copies `result` and `items` from the prompt, so the n-gram
    drafter keeps proposing what the rules forbid."""
    rules = {"bad_words": ["result", "items"], "min_tokens": 30, "return_token_ids": True}
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": EDIT}], "max_tokens": 60, "temperature": 0}
    spec, plain, digits = at_once(
        lambda: client.chat.completions.create(**kwargs, extra_body=rules),
        lambda: client.chat.completions.create(**kwargs, extra_body={**rules, **NO_SPEC}),
        lambda: client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=12, temperature=0,
                                          extra_body={"allowed_token_ids": list(range(32, 42))}))  # "0".."9"
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.model_extra["speculative_decoding"]["num_draft_tokens"] > 0
    ids = spec.choices[0].model_extra["token_ids"]
    assert len(ids) >= 30 and ids == plain.choices[0].model_extra["token_ids"]
    for word in ("result", " result", "items", " items"):
        banned = httpx.post(f"{stack.base_url}/tokenize", json={"model": MODEL, "prompt": word,
                                                                 "add_special_tokens": False}).json()["tokens"]
        assert not any(ids[i : i + len(banned)] == banned for i in range(len(ids))), word
    assert digits.choices[0].text.isdigit(), digits.choices[0].text


def test_what_the_verifier_refuses_is_a_400(client):
    """A grammar that does not compile, token ids outside the model's vocabulary (49152 ids)."""
    with pytest.raises(openai.BadRequestError, match="invalid"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, logit_bias={"999999": 1})
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"stop_token_ids": [49153]})
    # found by the fuzz run: llguidance's mask for this regular expression (a supplementary-plane character first)
    # admits a byte token its matcher then refuses, so the grammar cannot be followed: the request's fault, a 400
    with pytest.raises(openai.BadRequestError, match="grammar could not be followed"):
        client.completions.create(model=MODEL, prompt=" waving", max_tokens=5, top_p=0.28,
                                  extra_body={"guided_regex": "\U0006946c\f\u00dd\u0007\u0017"})


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string", "maxLength": 30}},
                                                             "required": ["city"], "additionalProperties": False}}}


def streamed_calls(chunks) -> tuple[dict[int, dict], str | None]:
    calls, finish = {}, None
    for chunk in chunks:
        for part in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_always_parse_streaming_or_not(client, choice):
    """SmolLM2-135M knows no tools: only the grammar makes its output a valid call, with speculation on."""
    import jsonschema

    messages = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    expected = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}
    reply, chunks = at_once(
        lambda: client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                               tool_choice=choice, max_tokens=150, temperature=0),
        lambda: list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                                    tool_choice=choice, max_tokens=150, temperature=0, stream=True)))
    assert reply.choices[0].finish_reason == "tool_calls", reply
    calls = reply.choices[0].message.tool_calls
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), expected[call.function.name]["function"]["parameters"])
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["get_time"]
    streamed, finish = streamed_calls(chunks)
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]

    second = client.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
                                            messages=[*messages, reply.choices[0].message.model_dump(exclude_none=True),
                                                      *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"}
                                                        for c in calls)])
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
