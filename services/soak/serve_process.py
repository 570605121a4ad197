"""`specserve serve` as a user runs it: one `python -m services.cli serve` process on free loopback ports, its
output in a log file, and what an operator would look at from outside: the gateway's /health, the launcher's
child processes (found in /proc by parent pid, so a restarted child is found too) and their resident memory.

The soak drives this, and the supervision end-to-end tests kill its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from services.supervision import free_ports
from services.modeling.registry import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
# Environment that would configure the children behind the flags' back (another API key, other limits).
_FOREIGN_ENV = ("SPECSERVE_VERIFIER_", "SPECSERVE_DRAFTER_", "SPECSERVE_GATEWAY_", "SPECSERVE_API_KEY")


@dataclass(frozen=True)
class ServePorts:
    gateway: int
    verifier: int
    verifier_metrics: int
    drafter: int
    drafter_metrics: int

    @classmethod
    def free(cls) -> ServePorts:
        return cls(*free_ports(5))

    def flags(self) -> list[str]:
        return ["--port", str(self.gateway), "--verifier-port", str(self.verifier),
                "--verifier-metrics-port", str(self.verifier_metrics), "--drafter-port", str(self.drafter),
                "--drafter-metrics-port", str(self.drafter_metrics)]


@dataclass
class ServeProcess:
    """One `specserve serve` stack. `extra_flags` go after the ports (e.g. a restart backoff)."""

    log_path: Path
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    max_model_len: int = 1024
    max_num_seqs: int = 8
    extra_flags: list[str] = field(default_factory=list)
    # settings the caller means the children to have (no flag sets them), applied after foreign ones are dropped
    extra_env: dict[str, str] = field(default_factory=dict)
    ports: ServePorts = field(default_factory=ServePorts.free)
    process: subprocess.Popen | None = None
    _seen_children: set[int] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.ports.gateway}"

    @property
    def verifier_metrics_url(self) -> str:
        return f"http://{HOST}:{self.ports.verifier_metrics}/metrics"

    @property
    def drafter_metrics_url(self) -> str:
        return f"http://{HOST}:{self.ports.drafter_metrics}/metrics"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "services.cli", "serve", "--model", self.model, "--device", self.device,
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--host", HOST, *self.ports.flags(), *self.extra_flags]

    def start(self, timeout_s: float = 300.0) -> Self:
        """Start the launcher and wait until the gateway reports the whole stack healthy."""
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV)}, **self.extra_env}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.argv(), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.wait_healthy(timeout_s)
        return self

    def health(self, timeout_s: float = 5.0) -> tuple[int, dict]:
        """The gateway's /health as (status code, body); (0, {}) when nothing answers."""
        try:
            response = httpx.get(f"{self.base_url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return 0, {}
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {}

    def wait_healthy(self, timeout_s: float, status: str = "ok") -> dict:
        """Until /health says `status` (the drafter is attached too); fails at once if the launcher exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"specserve serve exited with code {self.process.returncode}; see {self.log_path}")
            code, body = self.health()
            if code == 200 and body.get("status") == status:
                return body
            time.sleep(0.3)
        raise TimeoutError(f"/health never said {status!r} within {timeout_s:.0f} s; see {self.log_path}")

    def children(self) -> dict[str, int]:
        """The launcher's current children by service name (drafter, verifier, gateway)."""
        assert self.process is not None
        found = {}
        for pid in child_pids(self.process.pid):
            name = service_name(pid)
            if name:
                found[name] = pid
                self._seen_children.add(pid)
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the launcher (it stops its children in order); SIGKILL it and any child it left behind if
        it takes longer than `timeout_s`. Returns the launcher's exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.children()  # remember the current ones, in case they must be killed by hand
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self._seen_children:
            if service_name(pid):  # still alive and still ours
                os.kill(pid, signal.SIGKILL)
        return self.process.returncode


def child_pids(parent: int) -> list[int]:
    """Pids whose parent is `parent`, from /proc/*/stat (no psutil)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after "(comm)", which may hold spaces
        if len(fields) > 1 and int(fields[1]) == parent:
            pids.append(int(entry.name))
    return sorted(pids)


def service_name(pid: int) -> str | None:
    """'drafter', 'verifier' or 'gateway' for a `python -m services.cli <service>` process, else None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"services.cli" in argv:
        index = argv.index(b"services.cli") + 1
        if index < len(argv) and argv[index] in (b"drafter", b"verifier", b"gateway"):
            return argv[index].decode()
    return None
