"""Bad input gets the right status and an OpenAI-shaped error, and the app keeps serving afterwards."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError, from_grpc

MODEL = "tiny-test"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

BAD = [
    (COMP, b"{not json", 400, None),
    (COMP, b'{"model": "tiny-test", "prompt": "\xff\xfe"}', 400, None),
    (COMP, b"[1, 2]", 400, None),
    (COMP, {"prompt": "hi"}, 400, "model"),
    (COMP, {"model": MODEL}, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": []}, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": 5}, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (COMP, {"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    (COMP, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    (COMP, {"model": MODEL, "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    (COMP, {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    (COMP, {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (COMP, {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    (COMP, {"model": MODEL, "prompt": "hi", "n": 1000}, 400, "n"),
    (COMP, {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    (COMP, {"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (COMP, {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop"),
    (COMP, {"model": MODEL, "prompt": "hi", "speculative_config": {"method": "ngram", "k": 1}}, 400,
     "speculative_config"),
    (COMP, {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": MSGS, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"model": "nope", "messages": MSGS}, 404, "model"),
]


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("path,body,status,param", BAD)
async def test_bad_input(client, path, body, status, param):
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert_openai_error(r, status, param)
    ok = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


async def test_body_too_large(make_app):
    import httpx

    app = make_app(max_request_body_bytes=100)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post(COMP, json={"model": MODEL, "prompt": "x" * 200})
        assert_openai_error(r, 413)
        assert (await c.post(COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 1})).status_code == 200
    await app.state.gateway.client.close()


async def test_api_key(make_app):
    import httpx

    app = make_app(api_key="s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert_openai_error(await c.post(COMP, json=body), 401)
        assert_openai_error(await c.post(COMP, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_openai_error(await c.get("/v1/models"), 401)
        assert_openai_error(await c.post(COMP, content=b"{bad", headers={"Authorization": "Bearer x"}), 401)
        ok = await c.post(COMP, json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
    await app.state.gateway.client.close()


def test_api_key_from_environment(monkeypatch):
    from services.gateway.settings import GatewaySettings

    monkeypatch.setenv("SPECSERVE_API_KEY", "k1")
    monkeypatch.setenv("SPECSERVE_GATEWAY_PORT", "9001")
    settings = GatewaySettings()
    assert settings.api_key.get_secret_value() == "k1" and settings.port == 9001
    assert "k1" not in repr(settings)


def test_grpc_status_mapping():
    import grpc

    class FakeRpcError(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "why"

    expected = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.ALREADY_EXISTS: 400,
                grpc.StatusCode.RESOURCE_EXHAUSTED: 503, grpc.StatusCode.UNAVAILABLE: 503,
                grpc.StatusCode.DEADLINE_EXCEEDED: 503, grpc.StatusCode.INTERNAL: 500}
    for code, status in expected.items():
        error = from_grpc(FakeRpcError(code))
        assert isinstance(error, ApiError) and error.status == status
        assert error.body()["error"]["code"] == code.name.lower()


@pytest.mark.parametrize("matching", [True, False])
async def test_a_tokenizer_other_than_the_verifiers_is_refused(client, verifier, tokenizer, matching):
    from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint

    ours = tokenizer_fingerprint(tokenizer)
    verifier.tokenizer_fingerprint = ours if matching else "f" * 64
    response = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    if matching:
        assert response.status_code == 200
        return
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "tokenizer_mismatch" and "does not match the verifier's model" in error["message"]
    assert ours[:12] in error["message"]


def test_tokenizer_fingerprint_depends_on_the_vocabulary_only(tokenizer):
    from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
    from tests.gateway.fakes import byte_tokenizer

    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(byte_tokenizer())  # rebuilt: same digest
    grown = byte_tokenizer()
    grown.add_tokens(["<|extra|>"])
    assert tokenizer_fingerprint(grown) != tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(object()) == ""
