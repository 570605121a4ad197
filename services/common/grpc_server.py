"""The gRPC server bootstrap every service shares: grpc.aio server, standard health service, reflection, the
error-mapping interceptor, optional TLS, graceful stop and a SIGTERM hook.

Graceful stop is two-phase, the way Kubernetes expects: first report NOT_SERVING (readiness probes and
health-watching clients move traffic away while the server still answers), then `server.stop(grace)` lets the
RPCs in flight finish and refuses new ones. A stop runs once, however often it is asked for (a signal, then the
service's own exit path), and every caller waits for that one to end.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.grpc_errors import ErrorMappingInterceptor, StatusFor, default_status
from services.common.grpc_link_policy import DEFAULT_LINK_POLICY, LinkPolicy, with_options
from services.common.run_once import RunOnce
from services.common.startup_errors import PortUnavailableError

logger = logging.getLogger(__name__)

OVERALL_HEALTH = ""  # the health service's name for "the whole server"
# grpc.aio's tasks of one call each (their coroutines' names; grpcio 1.6x-1.7x): see settle_calls
CALL_COROUTINES = frozenset({"_schedule_rpc_coro", "_handle_exceptions"})
SETTLE_S = 1.0  # how long a stopped server's call tasks have to finish before the service goes on


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    port: int  # the bound port (the real one when 0 was asked for)
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    _stopping: RunOnce = field(default_factory=lambda: RunOnce("specserve-grpc-stop"), repr=False)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in (OVERALL_HEALTH, *self.service_names):
            await self.health.set(name, status)

    async def graceful_stop(self, drain_s: float = 0.0, grace_s: float = 5.0) -> None:
        """NOT_SERVING now, keep answering for `drain_s` so load balancers notice, then stop with `grace_s`
        for the RPCs still in flight. Started once; a later call waits for that stop (its arguments unused)."""
        await self._stopping.run(lambda: self._stop(drain_s, grace_s))

    async def _stop(self, drain_s: float, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        if drain_s > 0:
            await asyncio.sleep(drain_s)
        await self.server.stop(grace_s)
        await settle_calls(SETTLE_S)

    async def wait(self) -> None:
        """Until the server has terminated and a stop in progress has ended (a service that returns as soon as
        the server terminates would tear its loop down under the rest of that stop)."""
        await self.server.wait_for_termination()
        await self._stopping.wait()


async def settle_calls(timeout_s: float) -> None:
    """Wait (at most `timeout_s`) for grpc.aio's per-call tasks still on the loop after `server.stop`.

    The server's stop returns once no call is live in grpc's core, but a call that ended there (its client
    went away, or the grace ran out) still has a task here until the core's completion reaches the loop. A loop
    torn down before that cancels the task, and grpc logs "Exception not handled by _handle_exceptions in
    servicer method ...: CancelledError" for every such call: noise at each shutdown that looks like an error
    (stopping `specserve serve` showed it for the gateway's shared GenerateMany calls). The tasks are found by
    their coroutines' names, grpc's internals; should those change, nothing is found and nothing waits."""
    me = asyncio.current_task()
    calls = [task for task in asyncio.all_tasks()
             if task is not me and getattr(task.get_coro(), "__name__", "") in CALL_COROUTINES]
    if calls:
        await asyncio.wait(calls, timeout=timeout_s)


async def start_grpc_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    options: Sequence[tuple[str, int | str]] = (),
    credentials: grpc.ServerCredentials | None = None,
    status_for: StatusFor = default_status,
    link_policy: LinkPolicy = DEFAULT_LINK_POLICY,
) -> GrpcServer:
    """Start a server with the services `register` adds (full names, e.g. "specserve.v1.Drafter", for health
    and reflection). Port 0 binds a free port; the bound one is returned. With `credentials` the port speaks
    TLS only (services.common.tls.server_credentials). Exceptions escaping a servicer become the status
    `status_for` names (grpc_errors). The server accepts the keepalive pings of `link_policy`'s clients
    (grpc_link_policy); `options` add to or override it. Raises PortUnavailableError if binding fails, also where
    another server already listens on the port: gRPC binds with SO_REUSEPORT by default, and a second verifier
    started on a stale one's port bound it too, the kernel then sharing the connections between the two (a
    gateway's link could land on a verifier serving another model)."""
    options = with_options([*link_policy.server_options(), ("grpc.so_reuseport", 0)], list(options))
    server = grpc.aio.server(options=options, interceptors=[ErrorMappingInterceptor(status_for)])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # gRPC's "Failed to bind", its reason only in its own log
        bound = 0
    if bound == 0:
        raise PortUnavailableError(f"could not bind a gRPC server to {host}:{port}: the port is in use or the "
                                   "address is not this machine's")
    await server.start()
    running = GrpcServer(server, bound, health_servicer, tuple(service_names))
    await running.set_serving(True)
    logger.info(
        "gRPC server for %s listening on %s:%d%s", ", ".join(service_names), host, bound, " (TLS)" if credentials else ""
    )
    return running


def install_sigterm_handler(on_signal: Callable[[], Awaitable[None]]) -> None:
    """Run `on_signal()` (typically a graceful stop) once on SIGTERM or SIGINT, on the running loop."""
    loop = asyncio.get_running_loop()
    started: list[asyncio.Task] = []  # keeps the task referenced; a second signal does not start another

    def handle(signum: int) -> None:
        logger.info("received %s; stopping gracefully", signal.Signals(signum).name)
        if not started:
            started.append(loop.create_task(on_signal()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)
