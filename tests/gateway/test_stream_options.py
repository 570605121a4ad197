"""stream_options as OpenAI and vLLM take it: only with stream true, null the same as absent, unknown keys refused,
and vLLM's continuous_usage_stats: every chunk carries the usage so far (with include_usage)."""

from __future__ import annotations

import pytest

from tests.gateway.test_http import MODEL, REPLY, sse_events

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 8}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_stream_options_without_stream_is_a_400(client, path, body):
    for stream in (False, None):
        r = await client.post(path, json={**body, "stream": stream, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"], r.text
    assert (await client.post(path, json={**body, "stream_options": None})).status_code == 200  # null: absent


async def test_unknown_stream_options_are_a_400(client):
    r = await client.post("/v1/completions", json={**COMPLETION, "stream": True,
                                                   "stream_options": {"include_usage": True, "usage_every": 2}})
    assert r.status_code == 400 and "usage_every" in r.json()["error"]["message"], r.text


async def test_include_usage_null_counts_as_absent(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                        "stream_options": {"include_usage": None}})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert all(e.get("usage") is None for e in events) and events[-1]["choices"]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = await client.post(path, json={**body, "stream": True, "stream_options": options})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    usages = [e["usage"] for e in events]
    assert all(u is not None and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] > completion[0] >= 0  # growing as tokens arrive
    assert events[-1]["choices"] == [] and usages[-1] == usages[-2]  # the final usage chunk, as with include_usage
    text = "".join((e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text") or "")
                   for e in events if e["choices"])
    assert text == (REPLY if path.endswith("chat/completions") else REPLY[:8])


async def test_continuous_usage_stats_alone_changes_nothing(client):
    """vLLM reads it only together with include_usage."""
    r = await client.post("/v1/completions", json={**COMPLETION, "stream": True,
                                                   "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 200 and all(e.get("usage") is None for e in sse_events(r.text))
