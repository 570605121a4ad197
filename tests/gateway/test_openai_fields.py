"""Every request field works or is refused by name: output constraints and logit_bias reach the verifier as the
proto says, fields this server does not implement are 400s that say why, unknown fields are 400s, nulls are
absent; the developer role, text content parts, an assistant prefill continued, and GET /v1/models/{id}."""

from __future__ import annotations

import json

import openai
import pytest

REPLY = "Hello, wörld! 你好. The end."  # the scripted verifier's default reply

MODEL = "tiny-test"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def post_chat(client, **fields):
    return await client.post("/v1/chat/completions", json={**CHAT, **fields})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("fields", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": 'start: "a"+'}, "grammar", 'start: "a"+'),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),  # vLLM's current field
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_fallback": True}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "[a-z]+"}, "guided_decoding_backend": "guidance"}, "regex", "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, "grammar", 'start: "a"+'),
    ({"structured_outputs": {"json_object": True}, "guided_decoding_backend": "auto"}, "json_object", True),
])
async def test_output_constraints_reach_the_verifier(client, verifier, fields, kind, value):
    for endpoint, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        verifier.requests.clear()
        r = await client.post(endpoint, json={**body, **fields})
        assert r.status_code == 200, r.text
        structured = verifier.requests[0].sampling.structured_output
        assert structured.WhichOneof("kind") == kind
        got = getattr(structured, kind)
        if kind == "json_schema":
            got = json.loads(got)
        elif kind == "choice":
            got = list(got.choices)
        assert got == value


async def test_text_format_and_no_constraint_send_none(client, verifier):
    for fields in ({}, {"response_format": {"type": "text"}}):
        verifier.requests.clear()
        assert (await post_chat(client, **fields)).status_code == 200
        assert not verifier.requests[0].sampling.HasField("structured_output")


async def test_logit_bias_reaches_the_verifier(client, verifier):
    r = await post_chat(client, logit_bias={"104": 5.5, "105": -100})
    assert r.status_code == 200, r.text
    assert dict(verifier.requests[0].sampling.logit_bias) == {104: 5.5, 105: -100.0}


@pytest.mark.parametrize(("fields", "named"), [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"best_of": 3}, "best_of"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities: only"),  # was refused as an unknown field
    ({"modalities": []}, "modalities: only"),
    ({"web_search_options": {}}, "web_search_options"),  # an empty object turns search on: was accepted, unused
    ({"no_such_field": 1}, "no_such_field"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"4294967296": 1}}, "logit_bias"),  # past uint32: was a 500 (protobuf refused the key)
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "regex, choice"),
    ({"structured_outputs": {"json_object": False}}, "exactly one"),
    ({"structured_outputs": {"json": "{oops"}}, "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structural_tag"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "backend"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs, guided_regex"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "llguidance"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "arguments"),
    ({"messages": [{"role": "user", "content": "hi", "surprise": 1}]}, "surprise"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "last message"),
    ({"continue_final_message": True}, "add_generation_prompt"),
])
async def test_unsupported_and_unknown_fields_are_refused_by_name(client, verifier, fields, named):
    r = await post_chat(client, **fields)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]
    assert not verifier.requests


@pytest.mark.parametrize(("path", "fields", "named"), [
    ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),  # was read as max_tokens 1
    ("/v1/chat/completions", {"temperature": False}, "temperature"),
    ("/v1/chat/completions", {"n": True}, "n"),
    ("/v1/chat/completions", {"seed": True}, "seed"),
    ("/v1/chat/completions", {"logit_bias": {"104": True}}, "logit_bias"),
    ("/v1/chat/completions", {"stop_token_ids": [5, False]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [72, True]}, "prompt"),  # was the token ids [72, 1]
    ("/v1/completions", {"prompt": [[72], [False]]}, "prompt"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),  # a count on completions (chat's is a boolean)
    ("/v1/chat/completions", {"speculative_config": {"method": "ngram", "num_speculative_tokens": True}},
     "num_speculative_tokens"),
])
async def test_a_boolean_where_numbers_go_is_refused_by_name(client, verifier, path, fields, named):
    body = {**CHAT, **fields} if path.endswith("chat/completions") else {"model": MODEL, "prompt": "hi", **fields}
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert f"{named}: expected numbers, got a boolean" in r.json()["error"]["message"], r.text
    assert not verifier.requests


async def test_booleans_where_booleans_go_and_numbers_stay_accepted(client, verifier):
    r = await post_chat(client, logprobs=True, top_logprobs=0, stream=False, temperature=0, max_tokens=3, n=1,
                        logit_bias={"104": 1}, ignore_eos=False)
    assert r.status_code == 200, r.text
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [72, 105], "logprobs": 0, "echo": False,
                                                   "max_tokens": 2})
    assert r.status_code == 200, r.text


async def test_fields_that_cannot_change_the_output_and_nulls_are_accepted(client, verifier):
    r = await post_chat(client, user="u1", safety_identifier="s1", prompt_cache_key="k1", metadata={"k": "v"},
                        store=False, service_tier="auto", modalities=["text"],
                        parallel_tool_calls=True, tools=[], tool_choice="none", best_of=1, audio=None,
                        messages=[{"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None},
                                  {"role": "user", "content": "hi"}])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY


async def test_every_parameter_openai_declares_nullable_takes_null_as_its_default(client, verifier):
    """Clients that write every parameter out send null for those they leave unset: OpenAI's API declares n,
    logprobs, echo, stream and the sampling fields nullable; each null is the default, never a 400."""
    chat_nullable = ["n", "logprobs", "top_logprobs", "stream", "stream_options", "temperature", "top_p", "seed",
                     "stop", "max_tokens", "max_completion_tokens", "presence_penalty", "frequency_penalty",
                     "logit_bias", "user", "response_format", "tools", "tool_choice", "parallel_tool_calls",
                     "metadata", "store", "service_tier"]
    r = await post_chat(client, **{name: None for name in chat_nullable})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY and r.json()["choices"][0]["logprobs"] is None
    completion_nullable = ["n", "echo", "logprobs", "stream", "stream_options", "temperature", "top_p", "seed",
                           "stop", "presence_penalty", "frequency_penalty", "logit_bias", "user", "suffix", "best_of"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                   **{name: None for name in completion_nullable}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and not r.json()["choices"][0]["text"].startswith("hi")  # n 1, no echo
    r = await post_chat(client, ignore_eos=None)  # vLLM's own extensions are not nullable there either
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


async def test_developer_role_text_parts_and_a_continued_assistant_prefill(client, verifier, tokenizer):
    r = await post_chat(client, messages=[{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "h"},
                                                                       {"type": "text", "text": "i"}]}])
    assert r.status_code == 200, r.text
    assert tokenizer.decode(list(verifier.requests[0].prompt_token_ids)) == (
        "<|system|>be brief\n<|user|>hi\n<|assistant|>")
    verifier.requests.clear()
    r = await post_chat(client, continue_final_message=True, add_generation_prompt=False,
                        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}])
    assert r.status_code == 200, r.text
    assert tokenizer.decode(list(verifier.requests[0].prompt_token_ids)) == "<|user|>hi\n<|assistant|>Sure,"


def test_models_by_id_with_the_sdk(served):
    client = openai.OpenAI(base_url=served() + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("other-model")
    with pytest.raises(openai.BadRequestError, match="chat/completions only"):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"tools": [
            {"type": "function", "function": {"name": "f", "parameters": {}}}]})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          response_format={"type": "json_object"}, logit_bias={"5": 1})
    assert chat.choices[0].message.content == REPLY  # the scripted verifier ignores constraints: shape only
