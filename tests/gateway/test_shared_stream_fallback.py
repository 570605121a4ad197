"""--verifier-shared-stream against a verifier without GenerateMany (one from before it): the request is served
by a Generate call, and so are the next ones."""

from __future__ import annotations

import httpx

MODEL = "tiny-test"
COMP = "/v1/completions"
REPLY = "Hello, wörld! 你好. The end."


async def test_a_verifier_without_generate_many_is_sent_a_generate_call_per_request(make_app, verifier):
    app = make_app(verifier_shared_stream=True)
    verifier_client = app.state.gateway.client
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        for _ in range(2):
            r = await client.post(COMP, json={"model": MODEL, "prompt": "Hi", "max_tokens": 99})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == REPLY
    await verifier_client.close()
    assert len(verifier.requests) == 2  # each answered by the scripted verifier's Generate
