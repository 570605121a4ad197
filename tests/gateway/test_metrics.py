"""The gateway's metrics after real requests through the app (scripted verifier over real gRPC): latency
histograms by method, finished choices by finish reason, requests by status, and the speculation counters equal
to what the responses report."""

from __future__ import annotations

import json

import httpx

from services.gateway.metrics import GatewayMetrics

MODEL = "tiny-test"


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


async def test_latency_finish_reasons_status_and_speculation(make_app, verifier):
    app = make_app()
    metrics: GatewayMetrics = app.state.gateway.metrics
    verifier.tokens_per_step = 4
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        plain, two, streamed, missing = await send_requests(client)
    await app.state.gateway.client.close()
    assert (plain.status_code, two.status_code, streamed.status_code, missing.status_code) == (200, 200, 200, 404)

    assert [c["finish_reason"] for c in plain.json()["choices"]] == ["stop"]
    assert [c["finish_reason"] for c in two.json()["choices"]] == ["length", "length"]
    assert value(metrics, "specserve_gateway_request_success_total", model_name=MODEL, finished_reason="stop") == 2
    assert value(metrics, "specserve_gateway_request_success_total", model_name=MODEL,
                 finished_reason="length") == 2
    assert value(metrics, "specserve_gateway_requests_total", endpoint="/v1/completions", status="200") == 2
    assert value(metrics, "specserve_gateway_requests_total", endpoint="/v1/completions", status="404") == 1
    assert value(metrics, "specserve_gateway_requests_total", endpoint="/v1/chat/completions", status="200") == 1

    # one first token per choice; every later message is one inter-token gap; one e2e per answered request
    steps_plain = -(-(len(plain.json()["choices"][0]["text"].encode()) + 1) // 4)  # reply + EOS, 4 a message
    steps_two = -(-6 // 4)
    ttft = "specserve_gateway_time_to_first_token_seconds_count"
    itl = "specserve_gateway_inter_token_latency_seconds_count"
    e2e = "specserve_gateway_e2e_request_latency_seconds_count"
    assert value(metrics, ttft, model_name=MODEL, method="none") == 1
    assert value(metrics, itl, model_name=MODEL, method="none") == steps_plain - 1
    assert value(metrics, e2e, model_name=MODEL, method="none") == 1
    assert value(metrics, ttft, model_name=MODEL, method="ngram") == 3  # two choices + the chat stream
    assert value(metrics, itl, model_name=MODEL, method="ngram") == 2 * (steps_two - 1) + steps_plain - 1
    assert value(metrics, e2e, model_name=MODEL, method="ngram") == 2
    assert value(metrics, "specserve_gateway_e2e_request_latency_seconds_sum", model_name=MODEL, method="ngram") > 0

    spec = two.json()["speculative_decoding"]
    streamed_spec = [line for line in streamed.text.splitlines() if '"speculative_decoding":{' in line]
    assert streamed_spec, "the last chunk carries the request's speculation stats"
    last = json.loads(streamed_spec[-1][len("data: "):])["speculative_decoding"]
    for counter, field in (("num_drafts", "num_drafts"), ("num_draft_tokens", "num_draft_tokens"),
                           ("num_accepted_tokens", "num_accepted_tokens")):
        total = value(metrics, f"specserve_gateway_spec_decode_{counter}_total", model_name=MODEL, method="ngram")
        assert total == spec[field] + last[field]
    assert spec["num_draft_tokens"] + last["num_draft_tokens"] > 0
    assert value(metrics, "specserve_gateway_spec_decode_num_drafts_total", model_name=MODEL, method="none") == 0

    # vLLM's names for the same quantities, summed over methods, so vLLM dashboards read them unchanged
    for vllm_name, ours in (("vllm:time_to_first_token_seconds_count", ttft),
                            ("vllm:inter_token_latency_seconds_count", itl),
                            ("vllm:e2e_request_latency_seconds_count", e2e)):
        assert value(metrics, vllm_name, model_name=MODEL) == sum(
            value(metrics, ours, model_name=MODEL, method=m) for m in ("none", "ngram")) > 0, vllm_name
    for reason in ("stop", "length"):
        assert value(metrics, "vllm:request_success_total", model_name=MODEL, finished_reason=reason) == 2
    for name in ("prompt_tokens_total", "generation_tokens_total"):
        assert value(metrics, f"vllm:{name}", model_name=MODEL) == value(
            metrics, f"specserve_gateway_{name}", model_name=MODEL) > 0


async def send_requests(client: httpx.AsyncClient) -> list[httpx.Response]:
    """No speculation (ends at EOS: stop), n = 2 cut by max_tokens (length), a chat stream (stop), an unknown
    model (404)."""
    return [
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 100,
                                                   "speculative_config": {"method": "none"}}),
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 6, "n": 2}),
        await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100, "stream": True}),
        await client.post("/v1/completions", json={"model": "other", "prompt": "Hi"}),
    ]
