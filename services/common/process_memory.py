"""A process's resident memory (VmRSS), read from Linux's /proc: one reader for the services, the soak and the
benches."""

from __future__ import annotations

from pathlib import Path


def vmrss(status: str) -> int | None:
    """Resident bytes from the text of a /proc/<pid>/status file; None if it has no VmRSS line."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def resident_bytes(pid: int | str = "self") -> int | None:
    """Resident bytes of process `pid` (this one by default); None where it is gone or there is no /proc."""
    try:
        return vmrss(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
