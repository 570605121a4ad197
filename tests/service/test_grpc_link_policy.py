"""The shared link policy. Keepalive: a client that pings while idle is never sent away by a server started with the
matching policy (the `make bench` failure "Too many pings" after minutes of idling), while the same client
against a server with gRPC's defaults is (the negative control, which shows the test can fail). Reconnects: a
client is back within the policy's backoff cap once its server is."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_link_policy import LinkPolicy
from services.common.grpc_server import start_grpc_server
from services.common.tls import open_channel

FAST = LinkPolicy(ping_interval_ms=300, ping_timeout_ms=2000)
GRPC_DEFAULT_LIKE = LinkPolicy(ping_interval_ms=600_000)  # idle pings allowed only every 5 minutes


async def _states_while_idle(server_policy: LinkPolicy, idle_s: float = 3.0, *,
                             until_not_ready: bool = False) -> list[str]:
    """The channel's state every 0.25 s for `idle_s` (or, with `until_not_ready`, until it first leaves READY:
    a loaded machine can take several seconds to send a pinging client away)."""
    server = await start_grpc_server(lambda _: None, [], link_policy=server_policy)
    channel = open_channel(f"127.0.0.1:{server.port}", None, [], link_policy=FAST)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        states = []
        for _ in range(int(idle_s / 0.25)):
            await asyncio.sleep(0.25)
            states.append(channel.get_state(try_to_connect=False).name)
            if until_not_ready and states[-1] != "READY":
                break
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return states
    finally:
        await channel.close()
        await server.server.stop(0)


async def test_idle_client_stays_connected_with_the_shared_policy():
    states = await _states_while_idle(FAST)
    assert set(states) == {"READY"}, states


async def test_mismatched_server_sends_a_pinging_client_away():
    states = await _states_while_idle(GRPC_DEFAULT_LIKE, idle_s=30.0, until_not_ready=True)
    assert "READY" in states and states[-1] != "READY", states


def test_server_accepts_pings_at_the_client_interval():
    policy = LinkPolicy()
    client = dict(policy.client_options())
    server = dict(policy.server_options())
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]


async def test_a_client_reconnects_within_the_policy_cap_once_its_server_is_back():
    """A verifier restarted by `specserve serve` is back in seconds; gRPC's default backoff (up to 120 s) would
    keep the gateway failing fast long after that."""
    policy = LinkPolicy(reconnect_initial_ms=100, reconnect_max_ms=1_000)
    server = await start_grpc_server(lambda _: None, [], link_policy=policy)
    port = server.port
    channel = open_channel(f"127.0.0.1:{port}", None, [], link_policy=policy)
    stub = health_pb2_grpc.HealthStub(channel)

    async def check() -> bool:
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.aio.AioRpcError:
            return False
        return True

    try:
        assert await check()
        await server.server.stop(0)
        loop = asyncio.get_running_loop()
        down_until = loop.time() + 4.0
        while loop.time() < down_until:  # calls fail meanwhile, and the channel backs off
            assert not await check()
            await asyncio.sleep(0.2)
        server = await start_grpc_server(lambda _: None, [], port=port, link_policy=policy)
        back = loop.time()
        while not await check():
            await asyncio.sleep(0.05)
        assert loop.time() - back < policy.reconnect_max_ms / 1000 + 1.5
    finally:
        await channel.close()
        await server.server.stop(0)
