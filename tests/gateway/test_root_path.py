"""vLLM's --root-path: behind a reverse proxy that serves the API under a prefix and strips it before forwarding,
the gateway answers on its usual routes, counts them under their own names, and writes the prefix into the URLs
it hands out (the /docs page's). Served by uvicorn with the options `specserve gateway` starts it with."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from pydantic import ValidationError

from services.gateway.app import create_app
from services.gateway.main import parse_args, server_options
from services.gateway.settings import GatewaySettings
from tests.ports import free_port


def test_behind_a_prefix_stripping_proxy_the_routes_answer_and_the_docs_carry_the_prefix(scripted, verifier,
                                                                                           tokenizer):
    settings = parse_args(["--verifier", scripted[1], "--root-path", "/specserve", "--port", str(free_port()),
                           "--uvicorn-log-level", "warning"])
    assert settings.root_path == "/specserve"
    app = create_app(settings, tokenizer=tokenizer)
    server = uvicorn.Server(uvicorn.Config(app, **server_options(settings)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        with httpx.Client(base_url=f"http://127.0.0.1:{settings.port}", timeout=30) as http:  # what the proxy sends
            assert http.get("/v1/models").status_code == 200
            completion = http.post("/v1/completions", json={"model": "tiny-test", "prompt": "Hi", "max_tokens": 4})
            assert completion.status_code == 200, completion.text
            assert "/specserve/openapi.json" in http.get("/docs").text  # the browser fetches it through the proxy
            assert http.get("/openapi.json").json()["servers"] == [{"url": "/specserve"}]
            metrics = http.get("/metrics").text
        assert 'specserve_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics
        assert 'specserve_gateway_requests_total{endpoint="/v1/models",status="200"} 1.0' in metrics
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("root_path", ["specserve", "/specserve/", "/a b", "/a?b"])
def test_a_root_path_that_is_not_a_path_prefix_is_refused_at_start_up(root_path):
    with pytest.raises(ValidationError, match="root_path"):
        GatewaySettings(root_path=root_path)
