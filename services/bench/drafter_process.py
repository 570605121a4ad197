"""A `specserve drafter` process on a free port for the benchmarks that reach their drafter over gRPC, as deployed."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

from services.bench.http_runs import free_ports
from services.supervision import stop_processes, wait_for_port


@contextlib.contextmanager
def drafter_process(argv_tail: Sequence[str], progress: Callable[[str], None],
                    start_timeout_s: float = 600) -> Iterator[tuple[str, int]]:
    """`specserve drafter ARGV_TAIL` on a free port (its metrics on another), logging to a temporary file; yields
    (address, pid) once it listens and stops it afterwards."""
    port, = free_ports(1)
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process; closed below
        "w", prefix="specserve-bench-drafter-", suffix=".log", delete=False)
    argv = [sys.executable, "-m", "services.cli", "drafter", *argv_tail, "--port", str(port), "--metrics-port", "0"]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, process, start_timeout_s)
        progress(f"drafter process (pid {process.pid}) {' '.join(argv_tail)} on 127.0.0.1:{port}; log {log.name}")
        yield f"127.0.0.1:{port}", process.pid
    finally:
        stop_processes([process])
        log.close()
