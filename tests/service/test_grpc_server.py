"""The shared gRPC bootstrap: health reports SERVING, and NOT_SERVING as soon as a graceful stop begins (while
the server still answers, so probes see it); reflection lists the services; the drafter command runs as a
process and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.drafter_wire import drafter_pb2, drafter_pb2_grpc
from services.common.grpc_server import start_grpc_server
from services.drafter.server import SERVICE_NAME
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_goes_not_serving_when_graceful_stop_begins(ngram_drafter):
    server, port = ngram_drafter
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert (await watch.read()).status == SERVING

        stopping = asyncio.create_task(server.graceful_stop(drain_s=0.5, grace_s=1.0))
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)  # still answering
        assert reply.status == NOT_SERVING
        await asyncio.wait_for(stopping, 5)


def test_a_stopped_server_leaves_no_call_task_for_the_loop_to_cancel(caplog):
    """A long-lived call whose client leaves while the server stops (the gateway's shared GenerateMany calls when
    `specserve serve` stops) ends in grpc's core before its task on the loop does. A service that returned then
    had its loop cancel that task, and grpc logged "Exception not handled by _handle_exceptions" for it (in about
    half of these runs before)."""

    async def scenario() -> None:
        server = await start_grpc_server(lambda _: None, [], port=0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == SERVING
        first = asyncio.create_task(server.graceful_stop(grace_s=5.0))
        await asyncio.sleep(0.05)  # the client leaves while server.stop waits out its grace
        await channel.close()
        await server.wait()  # as a service's main does; no wait_for, whose task would give the loop more turns
        assert first.done()

    with caplog.at_level(logging.DEBUG, logger="grpc"):
        for _ in range(10):
            asyncio.run(scenario())
    assert not [record for record in caplog.records if "not handled" in record.getMessage()]


async def test_a_port_another_server_listens_on_is_refused_not_shared():
    """gRPC binds with SO_REUSEPORT by default: a second server on a stale one's port bound it too, and the kernel
    shared the connections between them. Now the second start fails, saying why."""
    import pytest

    from services.common.startup_errors import PortUnavailableError

    first = await start_grpc_server(lambda _: None, [], port=0)
    try:
        with pytest.raises(PortUnavailableError, match=f"127.0.0.1:{first.port}: the port is in use"):
            await start_grpc_server(lambda _: None, [], port=first.port)
    finally:
        await first.graceful_stop(grace_s=0)


async def test_reflection_lists_the_services(ngram_drafter):
    _, port = ngram_drafter
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        names = {s.name for s in reply.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
        call.cancel()


async def test_drafter_command_serves_and_stops_on_sigterm():
    metrics_port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.drafter.server",
        "--port",
        "0",
        "--num-speculative-tokens",
        "4",
        "--metrics-port",
        str(metrics_port),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        port = None
        while port is None:
            line = (await asyncio.wait_for(process.stdout.readline(), 20)).decode()
            assert line, "the drafter exited before listening"
            if match := re.search(r"drafter \(ngram\) listening on grpc://[\d.]+:(\d+)", line):
                port = int(match.group(1))
        while "metrics on" not in line:
            line = (await asyncio.wait_for(process.stdout.readline(), 20)).decode()
            assert line, "the drafter exited before serving metrics"
        assert f"http://127.0.0.1:{metrics_port}/metrics" in line
        scrape = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        )
        assert 'specserve_drafter_open_streams{method="ngram"} 0.0' in scrape
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = await drafter_pb2_grpc.DrafterStub(channel).Info(
                drafter_pb2.DrafterInfoRequest(), timeout=5
            )
        assert (info.method, info.max_speculative_tokens, info.vocab_size) == ("ngram", 4, 0)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
