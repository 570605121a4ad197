"""Two real verifier processes behind one gateway (`--verifier host:port,host:port`), as the Helm chart runs
verifier replicas behind a headless Service: requests are spread over both, a verifier that reports NOT_SERVING
(draining after SIGTERM) gets no new requests although its port still answers, and one that is killed costs no
request; once it is back it takes its share again."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.supervision import stop_processes, wait_for_port
from tests.e2e.requests import MODEL
from tests.ports import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = "specserve_verify_step_seconds"  # a histogram: its _count grows with every engine step a verifier runs


@dataclass
class Verifier:
    """One `specserve verifier` process; a long drain so a SIGTERM leaves it answering but NOT_SERVING."""

    logs: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def start(self) -> Verifier:
        self.spawn()
        self.wait_listening()
        return self

    def spawn(self) -> None:
        log = open(self.logs / f"verifier-{self.port}.log", "a")  # noqa: SIM115 - lives with the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "verifier", "--model", MODEL, "--device", "cpu",
             "--max-model-len", "512", "--max-num-seqs", "2", "--compute-thread", "main",  # main: no measuring
             "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
             "--drain-seconds", "60"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        )

    def wait_listening(self) -> None:
        wait_for_port("127.0.0.1", self.port, self.process, 240.0)

    def steps(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return sum(sample.value for family in text_string_to_metric_families(text) if family.name == STEPS
                   for sample in family.samples if sample.name == f"{STEPS}_count")


@pytest.fixture(scope="module")
def verifiers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("verifier-replicas")
    started = [Verifier(logs), Verifier(logs)]
    for verifier in started:  # both load the model at once
        verifier.spawn()
    for verifier in started:
        verifier.wait_listening()
    yield started
    for verifier in started:  # killed, not stopped: a graceful stop would wait out the long drain
        verifier.process.kill()
        verifier.process.wait(timeout=10)


@pytest.fixture(scope="module")
def gateway(verifiers, tmp_path_factory):
    port = free_port()
    addresses = ",".join(f"127.0.0.1:{v.port}" for v in verifiers)
    log = open(tmp_path_factory.mktemp("gateway") / "gateway.log", "w")  # noqa: SIM115 - lives with the process
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway", "--model", MODEL, "--host", "127.0.0.1",
         "--port", str(port), "--verifier", addresses],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    wait_for_port("127.0.0.1", port, process, 120.0)
    yield f"http://127.0.0.1:{port}"
    stop_processes([process])


def _complete(base_url: str, prompt: str) -> None:
    r = httpx.post(f"{base_url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0


def _send(base_url: str, count: int) -> None:
    for i in range(count):
        _complete(base_url, f"Request {i}: the capital of France is")


def test_requests_are_spread_over_both_verifiers(gateway, verifiers):
    before = [v.steps() for v in verifiers]
    _send(gateway, 8)
    served = [v.steps() - b for v, b in zip(verifiers, before, strict=True)]
    assert all(steps > 0 for steps in served), served


def test_a_draining_verifier_gets_no_new_requests(gateway, verifiers):
    """SIGTERM: NOT_SERVING for --drain-seconds while the port still answers; the gateway's health-checked round
    robin leaves it out (a plain connection would keep sending it requests until it refuses them)."""
    draining, other = verifiers
    draining.process.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the health Watch stream reports NOT_SERVING at once; a margin for the gateway to act on it
    assert draining.process.poll() is None  # still up: only the health status tells it apart
    before = (draining.steps(), other.steps())
    _send(gateway, 6)
    assert draining.steps() == before[0]
    assert other.steps() > before[1]
    draining.process.kill()
    draining.process.wait(timeout=10)


def test_a_killed_verifier_costs_no_request_and_rejoins_when_back(gateway, verifiers):
    first, second = verifiers
    if first.process.poll() is None:  # run on its own: the previous test already stopped this one
        first.process.kill()
        first.process.wait(timeout=10)
    before = second.steps()
    _send(gateway, 4)  # the first verifier is gone: every request lands on the second
    assert second.steps() > before
    first.start()  # same port: the gateway's channel reconnects to it by itself
    deadline = time.monotonic() + 60
    rejoined = first.steps()
    while first.steps() == rejoined:
        assert time.monotonic() < deadline, "the restarted verifier never got a request"
        _send(gateway, 1)
    second.process.kill()  # now the other way round, without a drain: still no failed request
    second.process.wait(timeout=10)
    _send(gateway, 3)
