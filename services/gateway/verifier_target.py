"""Where the gateway's calls go when there is more than one verifier: gRPC client-side round robin, health-aware.

Why on the client: gRPC sends every call over one long-lived HTTP/2 connection, so behind a plain (kube-proxy)
Service every request of a gateway lands on the one pod its connection reached. Instead the channel connects to
every verifier address it is given and spreads calls over them round robin, skipping any whose gRPC health
service does not report SERVING: a verifier that is loading, or draining before a restart, gets no new requests
while the others take them. With one address this is exactly the single connection it always was.

`--verifier` (SPECSERVE_GATEWAY_VERIFIER) accepts:
  host:port                      one verifier; a name that resolves to several addresses balances over all of them
  dns:///name:port               every address of `name`, re-resolved as it changes (a Kubernetes headless Service)
  host1:port1,host2:port2,...    a fixed list; host names in it are resolved once, at start-up
  any other gRPC target (ipv4:..., ipv6:..., unix:...) is used as it is
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass

from services.common import protos

pb, _ = protos.load("verifier")

# The health entry the verifier sets SERVING once its model is loaded and NOT_SERVING when it starts draining.
VERIFIER_HEALTH_SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name


@dataclass(frozen=True)
class VerifierTarget:
    """A gRPC channel target plus the channel options that make it balance (and keep TLS names right)."""

    target: str
    authority: str | None = None  # the name TLS checks when `target` lists resolved addresses
    num_addresses: int = 1  # how many verifiers `target` lists (1 where gRPC resolves it: not known here)

    def channel_options(self) -> list[tuple[str, str]]:
        config = {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": VERIFIER_HEALTH_SERVICE},
        }
        options = [("grpc.service_config", json.dumps(config))]
        if self.authority:
            options.append(("grpc.default_authority", self.authority))
        return options


def _split_host_port(entry: str) -> tuple[str, int]:
    host, colon, port = entry.strip().rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"each address in a --verifier list must be host:port, got {entry!r}")
    return host.strip("[]"), int(port)


def _addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """`host` itself when it is an IP literal, else its IPv4 addresses (what the name resolves to right now)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"--verifier: cannot resolve {host!r} ({error}); for a set of verifiers that changes, "
                         f"use dns:///NAME:PORT") from error
    return sorted({ipaddress.ip_address(info[4][0]) for info in found})


def parse_verifier_target(spec: str) -> VerifierTarget:
    """The channel target for a `--verifier` value (see the module docstring)."""
    spec = spec.strip()
    if "," not in spec:
        return VerifierTarget(spec)  # host:port or a gRPC target URI: gRPC resolves it (dns: by default)
    entries = [entry for entry in spec.split(",") if entry.strip()]
    resolved = []
    for host, port in map(_split_host_port, entries):
        resolved += [(address, port) for address in _addresses(host, port)]
    versions = {address.version for address, _ in resolved}
    if len(versions) != 1:
        raise ValueError(f"--verifier {spec!r}: a list must be all IPv4 or all IPv6 addresses")
    if versions == {4}:
        target = "ipv4:" + ",".join(f"{address}:{port}" for address, port in resolved)
    else:
        target = "ipv6:" + ",".join(f"[{address}]:{port}" for address, port in resolved)
    return VerifierTarget(target, authority=_split_host_port(entries[0])[0], num_addresses=len(resolved))
