"""Each service's Prometheus `/metrics` on an HTTP port of its own (prometheus_client's threaded server), with
a handle to stop it: the verifier and the drafter serve their registries the same way."""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> MetricsEndpoint | None:
    """Serve `registry` at http://host:port/metrics; None (no endpoint) when port is 0 or None."""
    if not port:
        return None
    server, thread = start_http_server(port, host, registry=registry)
    return MetricsEndpoint(server, thread)
