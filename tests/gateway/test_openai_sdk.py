"""The official openai SDK (sync, async, streaming) against the gateway served by uvicorn, and a client that
disconnects mid-stream, which must cancel the verifier's Generate call and count its choice as aborted."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

MODEL = "tiny-test"
REPLY = "Hello, wörld! 你好. The end."


def test_sync_sdk(served):
    client = openai.OpenAI(base_url=served() + "/v1", api_key="unused")
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=64)
    assert c.choices[0].text == REPLY and c.usage.completion_tokens == len(REPLY.encode()) + 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == REPLY and chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == REPLY
    assert chunks[-1].usage.total_tokens > 0
    assert [m.id for m in client.models.list()] == [MODEL]


async def test_async_sdk_with_api_key(served):
    base = served(api_key="k") + "/v1"
    client = openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=64, stream=True, n=2)
    texts = {0: "", 1: ""}
    async for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: REPLY, 1: REPLY}
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_completion_tokens=5, extra_body={"top_k": 3})
    assert chat.choices[0].message.content == REPLY[:5] and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.completions.create(model=MODEL, prompt="Hi", temperature=3)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other", prompt="Hi")
    await client.close()


def aborted_choices(base: str) -> float:
    """specserve_gateway_request_success_total{finished_reason="abort"} as /metrics reports it."""
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith("specserve_gateway_request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for_aborted_choices(base: str, expected: float) -> float:
    deadline = time.monotonic() + 5
    while (found := aborted_choices(base)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_disconnect_cancels_generate(served, verifier):
    verifier.step_delay_s = 0.05
    verifier.reply = "x" * 200
    base = served()
    with httpx.Client(timeout=10) as http, http.stream("POST", base + "/v1/completions",
                     json={"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
        # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 5
    while not verifier.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(verifier.cancelled) == 1 and not verifier.completed
    assert wait_for_aborted_choices(base, 1) == 1  # the dashboard's "Finished choices" shows it


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_the_first_byte_cancels_generate(served, verifier, stream):
    """Non-streaming: nothing is written until the end; streaming: nothing until the first token (here a 3 s
    prefill). A client that gives up meanwhile frees its slot at once, not when there is something to write."""
    verifier.step_delay_s = 0.1
    verifier.first_delay_s = 3.0
    verifier.reply = "x" * 200
    base = served()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": stream}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(10, read=0.5)) as http:
        http.post(base + "/v1/completions", json=body)
    deadline = time.monotonic() + 1.5  # well before the first token exists
    while not verifier.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(verifier.cancelled) == 1 and not verifier.completed
    assert wait_for_aborted_choices(base, 1) == 1
