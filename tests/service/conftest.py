"""A real Drafter gRPC server on a free port, in the test's own event loop."""

from __future__ import annotations

import pytest

from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.drafter.server import serve


@pytest.fixture
async def ngram_drafter():
    """(server, port) of an ngram drafter (K <= 5, n-grams 1..3); stopped after the test."""
    server, port = await serve(NgramProposer(NgramSettings(1, 3)), "127.0.0.1", 0, num_speculative_tokens=5)
    try:
        yield server, port
    finally:
        await server.server.stop(0)
