"""What a service's start-up raises when this machine cannot run it as asked, in a module without torch or gRPC:
the CLI imports neither until the flags are valid, and prints these as the command's one-line error and exit 1
(as it does an unavailable model), not as a traceback."""

from __future__ import annotations


class DeviceUnavailableError(RuntimeError):
    """The device or dtype asked for cannot run here (no GPU visible, no torch_npu, no bfloat16 on it); the message
    says what to change."""


class PortUnavailableError(OSError):
    """A server could not bind its port: something already listens there, or the address is not this machine's."""
