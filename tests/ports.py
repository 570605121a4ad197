"""Free TCP ports on 127.0.0.1 for servers the tests start (a port is free when asked; tests bind it soon after)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
