"""The error a start-up raises when the device or dtype asked for cannot run here, in a module without torch: the
CLI imports no torch until the flags are valid, and prints this as the command's error, not as a traceback."""

from __future__ import annotations


class DeviceUnavailableError(RuntimeError):
    """The device or dtype asked for cannot run here (no GPU visible, no torch_npu, no bfloat16 on it); the message
    says what to change."""
