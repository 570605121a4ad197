"""Free TCP ports on 127.0.0.1 for servers the tests start, that never collide between pytest-xdist workers.

A port from bind(("127.0.0.1", 0)) is free when asked, but the test binds it a moment later, and meanwhile another
worker's bind(0), or any outgoing connection (the kernel takes client ports from the same ephemeral range), may take
it. So each worker hands out ports from its own band below the kernel's ephemeral range, counting upward: no other
worker uses the band, and no client connection lands in it. A port in the band that something already holds is
skipped (checked by binding it).
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

from services.supervision import free_ports as free_ports_now

_BAND_SIZE = 1000
_LOWEST = 20000  # above the usual registered services, below Linux's ephemeral range (32768 by default)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_index() -> int:
    """0 for a run without xdist or its worker gw0, N for gwN."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0


def _band() -> range:
    """This worker's ports; empty where the machine's ephemeral range starts too low for bands."""
    start = _LOWEST + _worker_index() * _BAND_SIZE
    return range(start, start + _BAND_SIZE) if start + _BAND_SIZE <= _ephemeral_start() else range(0)


# Each test process walks its band in order; wrapping around reuses ports of servers long since stopped.
_BAND = _band()
_candidates = itertools.cycle(_BAND)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    if not _BAND:  # no band here: a port the kernel picks, as before bands
        return free_ports_now(1)[0]
    for _ in _BAND:
        port = next(_candidates)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in this worker's band {_BAND}")


def free_ports(count: int) -> list[int]:
    return [free_port() for _ in range(count)]
