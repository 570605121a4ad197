"""A request on the gateway's shared GenerateMany stream keeps its own deadline (VerifierClient's
request_timeout_s): updates that came in before it are delivered, then it ends DEADLINE_EXCEEDED and the verifier
is told to abort it; a request that finishes in time leaves no timer behind."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from services.gateway.verifier_client import VerifierClient, pb


@dataclass
class FakeStream:
    """What VerifierClient reads a shared stream through: start() gives the request's update queue (fed here by the
    test), finish() records how the request left it."""

    updates: list = field(default_factory=list)
    error: grpc.RpcError | None = None
    stub: object = None
    finished: list = field(default_factory=list)
    queue: asyncio.Queue | None = None

    async def start(self, request) -> asyncio.Queue:
        self.queue = asyncio.Queue()
        for update in self.updates:
            self.queue.put_nowait(update)
        return self.queue

    def finish(self, request_id: str, abort: bool) -> None:
        self.finished.append((request_id, abort))


def update(request_id: str, tokens: list[int], done: bool = False):
    reason = pb.FINISH_REASON_LENGTH if done else pb.FINISH_REASON_UNSPECIFIED
    return pb.RequestUpdate(request_id=request_id, output=pb.GenerateResponse(token_ids=tokens, finish_reason=reason))


def client_on(stream: FakeStream, timeout_s: float) -> VerifierClient:
    client = VerifierClient("127.0.0.1:1", request_timeout_s=timeout_s, shared_stream=True)
    client._shared_stream = lambda: stream
    return client


async def test_the_updates_before_the_deadline_come_then_deadline_exceeded_and_an_abort():
    stream = FakeStream([update("r", [1]), update("r", [2])])
    client = client_on(stream, timeout_s=0.2)
    request = pb.GenerateRequest(request_id="r", prompt_token_ids=[5])
    received = []

    async def read() -> None:
        async for output in client.generate(request):
            received.extend(output.token_ids)

    started = asyncio.get_running_loop().time()
    with pytest.raises(grpc.RpcError) as failure:
        await asyncio.wait_for(read(), 5.0)  # a request that never hears its deadline fails here, not hangs
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received == [1, 2]
    assert 0.2 <= asyncio.get_running_loop().time() - started < 2.0
    assert stream.finished == [("r", True)]  # not finished: the verifier is told to abort it


async def test_a_request_done_in_time_leaves_no_deadline_behind():
    stream = FakeStream([update("r", [1]), update("r", [2], done=True)])
    client = client_on(stream, timeout_s=0.1)
    outputs = [o async for o in client.generate(pb.GenerateRequest(request_id="r", prompt_token_ids=[5]))]
    assert [list(o.token_ids) for o in outputs] == [[1], [2]]
    assert stream.finished == [("r", False)]
    await asyncio.sleep(0.2)  # past the deadline: the cancelled timer put nothing in the finished request's queue
    assert stream.queue.empty()
