"""vLLM's CORS flags (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials): a browser page
of an allowed origin may call the API, its preflight answered without the API key (browsers send none on a
preflight); another origin gets no CORS headers, so its page cannot read the answer; none allowed by default."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.settings import GatewaySettings
from tests.gateway.test_http import MODEL

UI = "https://ui.example"
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


async def test_an_allowed_origins_page_may_call_the_api_and_others_may_not(make_app):
    app = make_app(allowed_origins=[UI], api_key="secret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        preflight = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == UI
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        call = await client.post("/v1/chat/completions", json=body,
                                 headers={"Origin": UI, "Authorization": "Bearer secret"})
        assert call.status_code == 200 and call.headers["access-control-allow-origin"] == UI
        unkeyed = await client.post("/v1/chat/completions", json=body, headers={"Origin": UI})
        assert unkeyed.status_code == 401  # CORS lets a page call; the key still decides who may
        other = await client.post("/v1/chat/completions", json=body,
                                  headers={"Origin": "https://elsewhere.example", "Authorization": "Bearer secret"})
        assert "access-control-allow-origin" not in other.headers
        refused = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://x.example"})
        assert refused.status_code == 400
    await app.state.gateway.client.close()


async def test_no_origin_is_allowed_by_default(client):
    preflight = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in preflight.headers
    models = await client.get("/v1/models", headers={"Origin": UI})
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers


def test_origins_come_as_vllms_json_list_or_comma_separated(monkeypatch):
    from services.gateway.main import parse_args

    assert parse_args(["--allowed-origins", '["*"]']).allowed_origins == ["*"]
    assert parse_args(["--allowed-origins", f"{UI}, http://localhost:3000"]).allowed_origins == [
        UI, "http://localhost:3000"]
    settings = parse_args(["--allowed-origins", UI, "--allowed-methods", '["GET", "POST"]', "--allow-credentials"])
    assert settings.allowed_methods == ["GET", "POST"] and settings.allow_credentials
    monkeypatch.setenv("SPECSERVE_GATEWAY_ALLOWED_ORIGINS", '["https://a.example"]')
    assert GatewaySettings().allowed_origins == ["https://a.example"]
    with pytest.raises(ValueError, match="not a JSON list"):
        GatewaySettings(allowed_origins='["unterminated')
