"""Bad input gets the right status and an OpenAI-shaped error, and the app keeps serving afterwards."""

from __future__ import annotations

import logging

import httpx
import pytest

from services.common.sampling_rules import LOGPROB_FLOOR
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
    (COMP, {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
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
    # json.loads takes what neither JSON nor the tokenizer can: each must be a 400, not a 500
    (COMP, b'{"model": "tiny-test", "prompt": "a\\ud800b"}', 400, "prompt"),
    (COMP, b'{"model": "tiny-test", "prompt": ["ok", "\\udc00"]}', 400, "prompt"),
    (CHAT, b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    (CHAT, (b'{"model": "tiny-test", "messages": [{"role": "user", "content": [{"type": "text", '
            b'"text": "\\uDBFF"}]}]}'), 400, "messages"),
    (COMP, b'{"model": "\\ud800", "prompt": "hi"}', 400, "model"),
    (COMP, b'{"model": "tiny-test", "prompt": "hi", "stop": ["\\ud800"]}', 400, "stop"),
    (COMP, b'{"model": "tiny-test", "prompt": "hi", "\\ud800": 1}', 400, None),
    (COMP, b'{"model": "tiny-test", "prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400, None),
    (COMP, b'{"model": "tiny-test", "prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     None),
    (COMP, b'{"model": "tiny-test", "prompt": "hi", "temperature": NaN}', 400, None),
    (COMP, b'{"model": "tiny-test", "prompt": "hi", "top_p": Infinity}', 400, None),
    (COMP, {"model": MODEL, "prompt": "hi", "seed": 2**64}, 400, "seed"),
    (COMP, {"model": MODEL, "prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    (COMP, {"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": [[1, 2]] * 300}, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": ["a"] * 5, "n": 13}, 400, None),
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


async def test_a_surrogate_pair_is_text(client, verifier):
    body = b'{"model": "tiny-test", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'
    r = await client.post(COMP, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert list(verifier.requests[0].prompt_token_ids) == list("\U0001F600".encode())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sent", [float("-inf"), float("nan")])
async def test_non_finite_logprobs_become_the_floor(client, verifier, stream, sent):
    """-inf is what a token outside top-p/top-k/min-p has; JSON cannot carry it (500) and SSE sent null."""
    verifier.logprob = sent
    r = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 1,
                                      "top_p": 0.5, "stream": stream})
    assert r.status_code == 200, r.text
    chunks = _sse(r.text) if stream else [r.json()]
    values = [v for c in chunks for ch in c["choices"] if ch["logprobs"]
              for v in ch["logprobs"]["token_logprobs"] + [x for d in ch["logprobs"]["top_logprobs"]
                                                           for x in d.values()]]
    r = await client.post(CHAT, json={"model": MODEL, "messages": MSGS, "max_tokens": 3, "logprobs": True,
                                      "top_logprobs": 1, "top_k": 5, "min_p": 0.1, "stream": stream})
    assert r.status_code == 200, r.text
    chunks = _sse(r.text) if stream else [r.json()]
    values += [v for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["content"]
               for v in [t["logprob"], *(x["logprob"] for x in t["top_logprobs"])]]
    assert len(values) == 12 and values == [LOGPROB_FLOOR] * 12


def _sse(text: str) -> list[dict]:
    import json

    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("top_k,sent", [(2**32, 0), (10**30, 0), (2**32 - 1, 2**32 - 1), (-1, 0), (40, 40)])
async def test_top_k_beyond_uint32_is_disabled(client, verifier, top_k, sent):
    r = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "top_k": top_k})
    assert r.status_code == 200, r.text
    assert verifier.requests[0].sampling.top_k == sent


@pytest.mark.parametrize("temperature,sent", [(1e-45, 0.0), (1e-38, 0.0), (9e-6, 0.0), (0.0, 0.0),
                                              (1e-5, 1e-5), (0.7, 0.7)])
async def test_a_vanishing_temperature_is_greedy(client, verifier, temperature, sent):
    r = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1,
                                      "temperature": temperature})
    assert r.status_code == 200, r.text
    assert verifier.requests[0].sampling.temperature == pytest.approx(sent, rel=1e-6, abs=0)  # not a denormal


async def test_a_top_p_float32_cannot_hold_keeps_the_top_token(client, verifier):
    r = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "top_p": 1e-50})
    assert r.status_code == 200, r.text
    assert 0 < verifier.requests[0].sampling.top_p < 1e-6


@pytest.mark.parametrize("seed,n,sent", [(-1, 1, [2**64 - 1]), (-(2**63), 1, [2**63]),
                                         (2**64 - 1, 3, [2**64 - 1, 0, 1]), (7, 2, [7, 8])])
async def test_any_64_bit_seed_maps_into_uint64(client, verifier, seed, n, sent):
    r = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed, "n": n})
    assert r.status_code == 200, r.text
    assert sorted(req.sampling.seed for req in verifier.requests) == sorted(sent)


async def test_a_bug_is_an_openai_500_logged_once_and_counted(client, monkeypatch, caplog):
    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr("services.gateway.completion_routes.encode_prompt", broken)
    with caplog.at_level(logging.ERROR):
        r = await client.post(COMP, json={"model": MODEL, "prompt": "hi"})
    assert_openai_error(r, 500)
    assert r.json()["error"]["type"] == "server_error" and "boom" not in r.text
    logged = [rec for rec in caplog.records if rec.exc_info and "boom" in str(rec.exc_info[1])]
    assert len(logged) == 1, caplog.records
    metrics = (await client.get("/metrics")).text
    assert 'specserve_gateway_requests_total{endpoint="/v1/completions",status="500"} 1.0' in metrics


async def test_a_bug_mid_stream_ends_it_with_an_error_event(client, monkeypatch):
    from services.gateway.responses import LogprobFormatter

    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(LogprobFormatter, "completion", broken)
    r = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "logprobs": 1, "stream": True})
    assert r.status_code == 200
    assert _sse(r.text)[-1]["error"]["type"] == "server_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_overload_says_so_once_and_when_to_retry(client, verifier, stream):
    verifier.overloaded = True
    r = await client.post(COMP, json={"model": MODEL, "prompt": "hi", "stream": stream})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] == "1"
    message = r.json()["error"]["message"]
    assert message.lower().count("overloaded") == 1 and message.lower().count("retry") == 1, message
    assert "3 requests already waiting" in message


async def test_unavailable_has_retry_after():
    import grpc

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(verifier="127.0.0.1:1", info_timeout_s=1), tokenizer=object())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post(COMP, json={"model": MODEL, "prompt": "Hi"})
    await app.state.gateway.client.close()
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == grpc.StatusCode.UNAVAILABLE.name.lower()


async def test_a_route_this_server_does_not_have_is_a_404_naming_the_ones_it_has(client):
    for method, path in (("POST", "/v1/embeddings"), ("GET", "/v1/responses/resp_1"), ("GET", "/v1/chat/completion")):
        r = await client.request(method, path, json={"model": MODEL, "input": "hi"})
        assert_openai_error(r, 404)
        message = r.json()["error"]["message"]
        assert message.startswith(f"{method} {path} is not a route") and "/v1/chat/completions" in message, message
    r = await client.get("/v1/models/gpt-4")  # a route's own 404 keeps its message
    assert_openai_error(r, 404) and "gpt-4" in r.json()["error"]["message"]


async def test_405_keeps_its_allow_header(client):
    r = await client.get(COMP)
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"
    r = await client.delete("/v1/models")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


async def test_health_with_an_api_key_tells_the_status_only(make_app, verifier):
    from tests.gateway.fakes import pb

    verifier.drafters = [pb.DrafterStatus(name="ngram", method="ngram", address="10.0.0.7:50061",
                                          state=pb.DRAFTER_STATE_DISCONNECTED, detail="connection refused")]
    app = make_app(api_key="s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.get("/health")
    await app.state.gateway.client.close()
    assert r.status_code == 200 and r.json() == {"status": "degraded"}


async def test_health_when_down_with_an_api_key_tells_the_status_only():
    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(verifier="127.0.0.1:1", info_timeout_s=1, api_key="k"), tokenizer=object())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.get("/health")
    await app.state.gateway.client.close()
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}


async def test_health_without_an_api_key_keeps_the_detail(client, verifier):
    from tests.gateway.fakes import pb

    verifier.drafters = [pb.DrafterStatus(name="ngram", method="ngram", address="10.0.0.7:50061",
                                          state=pb.DRAFTER_STATE_SERVING)]
    body = (await client.get("/health")).json()
    assert body["status"] == "ok" and body["drafters"][0]["address"] == "10.0.0.7:50061" and body["verifier"]


async def test_a_chat_template_that_refuses_the_messages_is_a_400(scripted, verifier):
    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings
    from tests.gateway.fakes import byte_tokenizer

    strict = byte_tokenizer()
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must "
                            "alternate user/assistant') }}{% endif %}{{ messages[0]['content'] }}")
    app = create_app(GatewaySettings(verifier=scripted[1]), tokenizer=strict)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post(CHAT, json={"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]})
        ok = await c.post(CHAT, json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
    await app.state.gateway.client.close()
    assert_openai_error(r, 400, "messages")
    assert "roles must alternate" in r.json()["error"]["message"] and ok.status_code == 200


async def test_body_too_large(make_app):
    import httpx

    app = make_app(max_request_body_bytes=100)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post(COMP, json={"model": MODEL, "prompt": "x" * 200})
        assert_openai_error(r, 413)
        assert (await c.post(COMP, json={"model": MODEL, "prompt": "x", "max_tokens": 1})).status_code == 200
    await app.state.gateway.client.close()


async def test_a_compressed_body_is_inflated_under_the_size_limit(make_app, verifier):
    """Content-Encoding gzip or deflate (as HTTP clients and proxies configured to save upload bytes send it) is
    inflated; the size limit holds for what it inflates to, so a small body cannot expand without bound; another
    coding, or a body that is not whole data of its coding, is an OpenAI-shaped 4xx, and the gateway serves on."""
    import gzip
    import json
    import zlib

    import httpx

    app = make_app(max_request_body_bytes=2000)
    body = json.dumps({"model": MODEL, "prompt": "squeezed", "max_tokens": 2}).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        async def post(content: bytes, encoding: str):
            return await c.post(COMP, content=content, headers={"content-type": "application/json",
                                                                "content-encoding": encoding})

        for content, encoding in ((gzip.compress(body), "gzip"), (zlib.compress(body), "deflate"),
                                  (gzip.compress(body), "identity, gzip"), (body, "identity")):
            r = await post(content, encoding)
            assert r.status_code == 200, (encoding, r.text)
        assert [list(request.prompt_token_ids) for request in verifier.requests] == [list(b"squeezed")] * 4
        bomb = gzip.compress(b'{"model": "tiny-test", "prompt": "' + b"a" * 1_000_000 + b'"}')
        assert len(bomb) < 2000
        assert_openai_error(await post(bomb, "gzip"), 413)
        assert_openai_error(await post(gzip.compress(body), "br"), 415)
        assert_openai_error(await post(body, "gzip"), 400)  # not gzip at all
        assert_openai_error(await post(gzip.compress(body)[:-6], "gzip"), 400)  # cut short
        assert_openai_error(await post(gzip.compress(body) + b"junk", "gzip"), 400)
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
