"""The gateway's verifier client over two scripted verifiers (real gRPC servers with the standard health service):
calls are spread round robin, and a verifier whose health turns NOT_SERVING gets none until it is SERVING again.
The same with real verifier processes: tests/e2e/test_verifier_replicas.py."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway.verifier_client import VerifierClient, pb
from services.gateway.verifier_target import VERIFIER_HEALTH_SERVICE
from tests.gateway.fakes import ScriptedVerifier, pb_grpc


def _start(servicer: ScriptedVerifier) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set(VERIFIER_HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, health_servicer, port


@pytest.fixture
def two_verifiers():
    started = [(servicer, *_start(servicer)) for servicer in (ScriptedVerifier(), ScriptedVerifier())]
    yield started
    for _, server, _, _ in started:
        server.stop(0)


async def _generate(client: VerifierClient, count: int) -> None:
    for i in range(count):
        request = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                                     sampling=pb.SamplingParams(max_tokens=2))
        responses = [response async for response in client.generate(request)]
        assert responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


async def test_calls_are_spread_and_avoid_a_verifier_that_is_not_serving(two_verifiers):
    (first, _, first_health, first_port), (second, _, _, second_port) = two_verifiers
    client = VerifierClient(f"127.0.0.1:{first_port},127.0.0.1:{second_port}")
    try:
        await _generate(client, 10)
        assert len(first.requests) > 0 and len(second.requests) > 0
        assert len(first.requests) + len(second.requests) == 10

        first_health.set(VERIFIER_HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(0.5)  # the channel watches each verifier's health; the change arrives on that stream
        before = len(first.requests), len(second.requests)
        await _generate(client, 6)
        assert len(first.requests) == before[0] and len(second.requests) == before[1] + 6

        first_health.set(VERIFIER_HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(0.5)
        await _generate(client, 6)
        assert len(first.requests) > before[0]
    finally:
        await client.close()


async def test_a_single_verifier_without_a_health_service_is_still_used(scripted):
    """A server that does not implement grpc.health.v1 counts as healthy (as gRPC's health checking defines)."""
    servicer, address = scripted
    servicer.reset()
    client = VerifierClient(address)
    try:
        await _generate(client, 2)
        assert len(servicer.requests) == 2
    finally:
        await client.close()
