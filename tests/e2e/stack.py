"""The whole stack as real processes on free ports (drafter, verifier, gateway), for end-to-end tests.

Each service is started with its own CLI, exactly as `specserve serve` starts it, but individually so a test can
kill and restart the drafter."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.supervision import stop_processes, wait_for_port
from services.soak.serve_process import ServePorts
from tests.ports import free_port, free_ports

REPO = Path(__file__).resolve().parents[2]
# The modules that only send requests share one session-wide Stack (tests/e2e/conftest.py: shared_stack); under
# pytest-xdist they are one unit of work, SHARED_STACK_GROUP, so one worker runs them all and starts it once. They
# run in this order (tests/conftest.py): the Prometheus module first, whose dashboard ratios need counters that
# start at 0, as on a stack nobody has used yet.
SHARED_STACK_MODULES = tuple(f"tests/e2e/{name}.py" for name in
                             ("test_prometheus_metrics", "test_openai_stack", "test_prompt_scoring",
                              "test_fuzz_schemathesis", "test_readiness"))
SHARED_STACK_GROUP = "shared-e2e-stack"


def serve_ports() -> ServePorts:
    """Ports for a `specserve serve` (ServeProcess) from this worker's band (tests/ports.py)."""
    return ServePorts(*free_ports(5))


@dataclass
class Stack:
    model: str = "smollm2-135m-instruct"
    num_speculative_tokens: int = 5
    max_num_seqs: int = 8
    # The e2e stack pins the forwards to the main thread (asyncio loop on its own thread), so these tests cover
    # that arrangement; `specserve serve` (test_serve_supervision.py) covers the measured default, auto.
    compute_thread: str = "main"
    gateway_port: int = field(default_factory=free_port)
    verifier_port: int = field(default_factory=free_port)
    verifier_metrics_port: int = field(default_factory=free_port)
    drafter_port: int = field(default_factory=free_port)
    drafter_metrics_port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: Path = field(default_factory=lambda: Path(os.environ.get("TMPDIR", "/tmp")))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def _spawn(self, name: str, args: list[str], port: int, timeout_s: float = 180.0) -> None:
        log = open(self.logs / f"specserve-e2e-{name}-{port}.log", "w")  # noqa: SIM115 - lives with the process
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
        self.processes[name] = process
        wait_for_port("127.0.0.1", port, process, timeout_s)

    def start_drafter(self) -> None:
        self._spawn(
            "drafter",
            ["drafter", "--method", "ngram", "--num-speculative-tokens", str(self.num_speculative_tokens),
             "--host", "127.0.0.1", "--port", str(self.drafter_port),
             "--metrics-port", str(self.drafter_metrics_port)],
            self.drafter_port,
        )

    def stop_drafter(self) -> None:
        process = self.processes.pop("drafter")
        process.kill()
        process.wait(timeout=10)

    def start(self) -> Stack:
        self.start_drafter()
        spec = f'{{"method": "ngram", "num_speculative_tokens": {self.num_speculative_tokens}}}'
        self._spawn(
            "verifier",
            ["verifier", "--model", self.model, "--device", "cpu", "--max-num-seqs", str(self.max_num_seqs),
             "--max-model-len", "1024", "--speculative-config", spec, "--compute-thread", self.compute_thread,
             "--drafter", f"ngram=127.0.0.1:{self.drafter_port}", "--host", "127.0.0.1",
             "--port", str(self.verifier_port), "--metrics-port", str(self.verifier_metrics_port)],
            self.verifier_port,
        )
        self._spawn(
            "gateway",
            ["gateway", "--model", self.model, "--host", "127.0.0.1", "--port", str(self.gateway_port),
             "--verifier", f"127.0.0.1:{self.verifier_port}", "--verifier-shared-stream"],
            self.gateway_port,
        )
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("gateway never became healthy")

    def verifier_metric(self, name: str) -> float:
        """Sum of all samples of a metric on the verifier's /metrics (0 if absent)."""
        return self._metric(self.verifier_metrics_port, name)

    def drafter_metric(self, name: str) -> float:
        """Sum of all samples of a metric on the drafter's /metrics (0 if absent)."""
        return self._metric(self.drafter_metrics_port, name)

    @staticmethod
    def _metric(port: int, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                head, _, value = line.rpartition(" ")
                if head.split("{")[0] == name:
                    total += float(value)
        return total

    def stop(self) -> None:
        stop_processes(list(reversed(self.processes.values())))
        self.processes.clear()
