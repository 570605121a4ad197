"""One real stack (drafter, verifier with SmolLM2-135M, gateway) for every end-to-end module that only sends
requests to it: starting a stack costs a model load and the verifier's start-up measurements, so it is started once
per test process, not once per module. Modules that kill, restart or reconfigure services start their own.

Under pytest-xdist the modules using it (stack.SHARED_STACK_MODULES) are one unit of work (tests/conftest.py), so
one worker runs them all and starts the stack once."""

from __future__ import annotations

import pytest

from tests.e2e.stack import Stack


@pytest.fixture(scope="session")
def shared_stack():
    running = Stack().start()
    yield running
    running.stop()
