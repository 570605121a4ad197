"""The HTTP layer against a scripted verifier over real gRPC: responses, streaming, n > 1, usage and
speculation stats, stop strings, errors, health and metrics."""

from __future__ import annotations

import json

import pytest

from tests.gateway.fakes import pb

MODEL = "tiny-test"
REPLY = "Hello, wörld! 你好. The end."


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_completion(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == REPLY
    assert body["choices"][0]["finish_reason"] == "stop"
    n_out = len(REPLY.encode()) + 1  # + EOS
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": n_out, "total_tokens": 2 + n_out,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    spec = body["speculative_decoding"]
    assert spec["method"] == "ngram" and spec["num_drafts"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    assert list(verifier.requests[0].prompt_token_ids) == [72, 105]


async def test_length_echo_and_token_prompt(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [72, 105], "max_tokens": 5,
                                                   "echo": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hi" + REPLY[:5] and choice["finish_reason"] == "length"


async def test_stop_string_cancels_the_call(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100,
                                                   "stop": ["wör"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello, " and choice["finish_reason"] == "stop"


async def test_chat(client, verifier, tokenizer):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    prompt = tokenizer.decode(list(verifier.requests[0].prompt_token_ids))
    assert prompt == "<|system|>be brief\n<|user|>hi\n<|assistant|>"


async def test_chat_stream_with_usage(client):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == REPLY
    assert "\ufffd" not in "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    assert events[-1]["speculative_decoding"]["num_drafts"] > 0


async def test_completion_stream_n2_seeds_and_final_spec(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 2, "seed": 7,
                                                   "stream": True, "max_tokens": 50})
    events = sse_events(r.text)
    texts = {0: "", 1: ""}
    for e in events:
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert texts == {0: REPLY, 1: REPLY}
    assert sorted(req.sampling.seed for req in verifier.requests) == [7, 8]
    assert events[-1]["speculative_decoding"] is not None
    assert all(e["speculative_decoding"] is None for e in events[:-1])


async def test_non_stream_n3_and_logprobs(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2,
                                                   "max_tokens": 4, "logprobs": 1})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == REPLY[:4] for c in body["choices"])
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5] * 4
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                          "content": "x"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e"] and len(content[0]["top_logprobs"]) == 1


async def test_speculation_passthrough(client, verifier):
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                      "speculative_config": {"method": "none"}})
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    none, ngram = verifier.requests
    assert none.speculation.method == "none"
    assert ngram.speculation.method == "ngram" and ngram.speculation.num_speculative_tokens == 2


async def test_models_health_metrics(client, verifier):
    r = await client.get("/v1/models")
    card = r.json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] > 0
    assert card["root"] == MODEL and card["parent"] is None and card["owned_by"]  # vLLM's fields
    r = await client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    verifier.drafters = [pb.DrafterStatus(name="ngram", method="ngram", address="x:1",
                                          state=pb.DRAFTER_STATE_DISCONNECTED, detail="connection refused")]
    r = await client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "degraded"
    assert r.json()["drafters"][0]["state"] == "disconnected"
    for ping in (client.get("/ping"), client.post("/ping")):  # vLLM's (SageMaker's) health check
        r = await ping
        assert r.status_code == 200 and r.json()["status"] == "degraded"
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    text = (await client.get("/metrics")).text
    assert 'specserve_gateway_spec_decode_num_drafts_total{method="ngram",model_name="tiny-test"}' in text
    assert "specserve_gateway_time_to_first_token_seconds_count" in text
    assert 'specserve_gateway_requests_total{endpoint="/v1/completions",status="200"}' in text


async def test_health_when_verifier_is_down(make_app):
    import httpx

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(verifier="127.0.0.1:1", info_timeout_s=1), tokenizer=object())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert (await c.post("/ping")).status_code == 503
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert r.status_code == 503 and r.json()["error"]["message"]
    await app.state.gateway.client.close()


async def test_verifier_errors_map_to_http(client, verifier):
    verifier.overloaded = True
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True})
    assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
    verifier.overloaded = False
    verifier.max_model_len = 10  # the gateway cached 256; the verifier's INVALID_ARGUMENT must become a 400
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 20})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 20, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_prompt_too_long(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 300})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("prompt, named", [
    ([-1], "prompt[0] is -1"), ([5, "a"], "prompt[1] is a string"), ([[1, 2], [3, 1.5]], "prompt[1][1] is 1.5"),
    ([[7, None]], "prompt[0][1] is null"), ({"text": "hi"}, "prompt is an object"), ([2**40], "prompt[0] is 1099"),
])
async def test_a_prompt_of_no_known_shape_is_a_400_naming_the_wrong_item(client, verifier, prompt, named):
    """Not pydantic's report of the union's first branch ("prompt.str: Input should be a valid string")."""
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt", r.text
    assert named in error["message"] and "list of token ids" in error["message"]
    assert not verifier.requests


def test_a_gateway_without_its_tokenizer_is_not_ready_and_answers_503s(scripted, verifier, tmp_path):
    """No --model: the tokenizer is the verifier's model's, loaded at start-up in the background, never in a
    request. One that cannot be had leaves the gateway up but not ready, saying why; no request is a 500."""
    import threading
    import time

    import httpx
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings
    from tests.ports import free_port

    verifier.model_id = str(tmp_path / "gone" / "model.gguf")
    app = create_app(GatewaySettings(verifier=scripted[1]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 20
        while True:
            try:
                health = httpx.get(f"{base}/health", timeout=5)
                if health.json()["status"] != "starting":
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway never finished starting"
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert "does not exist" in health.json()["error"] and "model.gguf" in health.json()["error"]
        for path, body in (("/v1/completions", {"model": verifier.model_id, "prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": verifier.model_id, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})):
            response = httpx.post(f"{base}{path}", json=body, timeout=10)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "model_unavailable"
        assert not verifier.requests  # nothing reached the verifier
    finally:
        server.should_exit = True
        thread.join(timeout=10)
