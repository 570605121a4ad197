"""What /v1/completions returns of the prompt (`echo`, `echo` + `logprobs`, `max_tokens: 0`) and vLLM's
`prompt_logprobs` extension, against the scripted verifier (every logprob it sends is -0.5, every top
alternative is the token itself). The values themselves are checked against transformers in
tests/e2e/test_prompt_scoring.py."""

from __future__ import annotations

import pytest

from tests.gateway.test_http import MODEL, REPLY, sse_events


async def test_echo_with_logprobs_covers_the_prompt_then_the_output(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi!", "max_tokens": 3, "echo": True,
                                                   "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hi!" + REPLY[:3]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["H", "i", "!", "H", "e", "l"]
    assert logprobs["token_logprobs"] == [None, -0.5, -0.5, -0.5, -0.5, -0.5]
    assert logprobs["top_logprobs"] == [None, {"i": -0.5}, {"!": -0.5}, {"H": -0.5}, {"e": -0.5}, {"l": -0.5}]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert verifier.requests[0].sampling.prompt_logprobs == 1
    assert choice["prompt_logprobs"] is None  # the extension was not asked


async def test_max_tokens_0_with_echo_scores_the_prompt_only(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [72, 105], "max_tokens": 0,
                                                   "echo": True, "logprobs": 0})
    body = r.json()
    choice = body["choices"][0]
    assert r.status_code == 200 and choice["text"] == "Hi" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -0.5]
    assert choice["logprobs"]["top_logprobs"] == [None, {"i": -0.5}]  # logprobs 0: the prompt token itself
    assert body["usage"]["completion_tokens"] == 0 and verifier.requests[0].sampling.max_tokens == 0


async def test_without_echo_the_logprobs_and_the_verifier_request_are_as_before(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logprobs": 1})
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["H", "e"]
    assert not verifier.requests[0].sampling.HasField("prompt_logprobs")  # computed only when asked
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert r.json()["choices"][0]["text"] == "" and r.json()["choices"][0]["finish_reason"] == "length"


async def test_streaming_echo_leads_the_first_chunk_with_the_prompt_and_its_logprobs(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "echo": True,
                                                   "logprobs": 1, "stream": True})
    chunks = [e["choices"][0] for e in sse_events(r.text)]
    assert chunks[0]["text"].startswith("Hi") and "".join(c["text"] for c in chunks) == "Hi" + REPLY[:4]
    assert chunks[0]["logprobs"]["tokens"][:2] == ["H", "i"] and chunks[0]["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert tokens == ["H", "i", "H", "e", "l", "l"] and offsets == [0, 1, 2, 3, 4, 5]


async def test_prompt_logprobs_extension_in_vllm_shape(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hey", "max_tokens": 1,
                                                   "prompt_logprobs": 2, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["prompt_logprobs"] == [None, {"101": {"logprob": -0.5, "rank": 1, "decoded_token": "e"}},
                                         {"121": {"logprob": -0.5, "rank": 1, "decoded_token": "y"}}]
    assert verifier.requests[0].sampling.prompt_logprobs == 2  # one call serves echo's 1 and the extension's 2
    chat = await client.post("/v1/chat/completions", json={"model": MODEL, "prompt_logprobs": 0, "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "hi"}]})
    scores = chat.json()["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(verifier.requests[1].prompt_token_ids)


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"max_tokens": -1}, "max_tokens"),
])
async def test_bad_values_are_400(client, verifier, body, param):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
    assert r.status_code == 400 and param in r.json()["error"]["message"] + str(r.json()["error"]["param"])
    assert not verifier.requests
