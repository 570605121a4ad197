"""A Generate that loses its connection before the first message is re-issued once on a fresh channel; one that
has sent a token is never retried, and the retry does not cut other requests' calls short."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from services.gateway.verifier_client import connection_lost

MODEL = "tiny-test"
COMP = "/v1/completions"
REPLY = "Hello, wörld! 你好. The end."


def _events(text: str) -> list[dict]:
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.mark.parametrize("stream", [False, True])
async def test_unavailable_before_the_first_message_is_retried_on_a_fresh_channel(make_app, verifier, stream):
    app = make_app()
    verifier_client = app.state.gateway.client
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        await client.get("/v1/models")  # opens the channel
        first_channel = verifier_client._channel
        verifier.unavailable_calls = 1
        r = await client.post(COMP, json={"model": MODEL, "prompt": "Hi", "max_tokens": 99, "stream": stream})
        assert verifier_client._channel is not first_channel  # the retry went out on a fresh one
    await verifier_client.close()
    assert r.status_code == 200, r.text
    texts = [e["choices"][0]["text"] for e in _events(r.text)] if stream else [r.json()["choices"][0]["text"]]
    assert "".join(texts) == REPLY
    first, retry = verifier.requests
    assert retry.request_id == f"{first.request_id}-retry"  # the first id may still be taken on the verifier
    assert retry.prompt_token_ids == first.prompt_token_ids and retry.sampling == first.sampling


async def test_only_one_retry(client, verifier):
    verifier.unavailable_calls = 2
    r = await client.post(COMP, json={"model": MODEL, "prompt": "Hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert len(verifier.requests) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_never_retried_after_a_token(client, verifier, stream):
    verifier.unavailable_after_first = True
    r = await client.post(COMP, json={"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stream": stream})
    if stream:
        assert r.status_code == 200 and _events(r.text)[-1]["error"]["code"] == "unavailable"
    else:
        assert r.status_code == 503
    assert len(verifier.requests) == 1


async def test_a_refusal_is_not_retried(client, verifier):
    verifier.overloaded = True
    assert (await client.post(COMP, json={"model": MODEL, "prompt": "Hi"})).status_code == 503
    assert len(verifier.requests) == 1


async def test_the_retry_leaves_other_requests_running(client, verifier):
    verifier.step_delay_s = 0.02
    slow = asyncio.create_task(client.post(COMP, json={"model": MODEL, "prompt": "Hi", "max_tokens": 100}))
    while not verifier.requests:
        await asyncio.sleep(0.01)
    verifier.unavailable_calls = 1
    quick = await client.post(COMP, json={"model": MODEL, "prompt": "Yo", "max_tokens": 3})
    assert quick.status_code == 200 and len(verifier.requests) == 3
    r = await slow
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY  # on the old channel, it went on


class _Error(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code,details,lost", [
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM ... GOAWAY too_many_pings", True),
    (grpc.StatusCode.INTERNAL, "step failed: CUDA error", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt too long", False),
])
def test_what_counts_as_a_lost_connection(code, details, lost):
    assert connection_lost(_Error(code, details)) is lost
