"""Fixtures: one scripted verifier over real gRPC per session (reset per test), the app built around it, an
httpx client through ASGI, and the same app served by uvicorn on a free port for SDK and disconnect tests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tests.gateway.fakes import byte_tokenizer, start_scripted_verifier
from tests.ports import free_port


@pytest.fixture(scope="session")
def scripted():
    servicer, server, address = start_scripted_verifier()
    yield servicer, address
    server.stop(0)


@pytest.fixture
def verifier(scripted):
    servicer, _ = scripted
    servicer.reset()
    return servicer


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture
def make_app(scripted, verifier, tokenizer):
    def make(**overrides):
        settings = GatewaySettings(verifier=scripted[1], **overrides)
        return create_app(settings, tokenizer=tokenizer)
    return make


@pytest.fixture
async def client(make_app):
    app = make_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c
    await app.state.gateway.client.close()


@pytest.fixture
def served(make_app):
    """Base URL of the app served by a real uvicorn in a thread (its own event loop)."""
    def serve(**overrides):
        app = make_app(**overrides)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    servers: list = []
    yield serve
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
