"""POST /invocations (SageMaker's route, as vLLM serves it): each kind of body is answered by its own route, as if
sent there, streaming and the API key included; a body that is none of them, or more than one, is a 400."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "tiny-test"
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 5},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 5},
}


def without_ids(body: dict) -> dict:
    """A response with its per-request parts (ids, times) left out."""
    drop = {"id", "created", "created_at"}
    body = {k: v for k, v in body.items() if k not in drop}
    for item in body.get("output", []):
        item.pop("id", None)
    return body


@pytest.mark.parametrize("route", list(BODIES))
async def test_each_kind_of_body_is_answered_by_its_route(client, route):
    direct = await client.post(route, json=BODIES[route])
    invoked = await client.post("/invocations", json=BODIES[route])
    assert invoked.status_code == direct.status_code == 200, invoked.text
    assert without_ids(invoked.json()) == without_ids(direct.json())


async def test_streams_and_errors_are_the_routes_own(client):
    async with client.stream("POST", "/invocations", json={**BODIES["/v1/chat/completions"], "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "chat.completion.chunk"
    refused = await client.post("/invocations", json={**BODIES["/v1/completions"], "temperature": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("body", [{"model": MODEL}, {"model": MODEL, "prompt": "a", "messages": []}, [1, 2]])
async def test_a_body_of_no_kind_or_of_two_is_a_400(client, body):
    r = await client.post("/invocations", json=body)
    assert r.status_code == 400 and "an /invocations body is" in r.json()["error"]["message"]


async def test_the_api_key_guards_it(make_app):
    app = make_app(api_key="k")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert (await c.post("/invocations", json=BODIES["/v1/completions"])).status_code == 401
        ok = await c.post("/invocations", json=BODIES["/v1/completions"], headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
    await app.state.gateway.client.close()
