"""A real Prometheus server (Debian's `prometheus` package, put in place by deploy/scripts/install-test-tools.sh
from `make test`) scraping given targets every second, and its HTTP query API (instant and range queries).

The end-to-end metrics test and the dashboard picture both run it."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.supervision import free_ports, stop_processes, wait_for_port

INSTALL_HINT = ("run deploy/scripts/install-test-tools.sh (`make test` does), `apt-get install prometheus`, or "
                "set PROMETHEUS_BIN to a Prometheus >= 2.33 binary")


def prometheus_binary() -> str:
    """PROMETHEUS_BIN, else the one install-test-tools.sh unpacked next to this Python, else `prometheus` on
    PATH; FileNotFoundError (a test fails, it is never skipped) when there is none."""
    candidates = [os.environ.get("PROMETHEUS_BIN"), str(Path(sys.executable).parent / "prometheus"),
                  shutil.which("prometheus")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"no Prometheus server binary found: {INSTALL_HINT}")


def scrape_config(targets: dict[str, str], interval_s: int = 1) -> str:
    """prometheus.yml scraping each job's one `host:port` at /metrics."""
    lines = ["global:", f"  scrape_interval: {interval_s}s", f"  scrape_timeout: {interval_s}s",
             "  evaluation_interval: 1s", "scrape_configs:"]
    for job, target in targets.items():
        lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: ['{target}']"]
    return "\n".join(lines) + "\n"


class PromQLError(RuntimeError):
    """A query Prometheus refused, or one that did not give what was asked."""


@dataclass
class PrometheusServer:
    targets: dict[str, str]  # job name -> host:port serving /metrics
    folder: Path
    port: int = field(default_factory=lambda: free_ports(1)[0])
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        binary = prometheus_binary()
        config = self.folder / "prometheus.yml"
        config.write_text(scrape_config(self.targets))
        with open(self.folder / "prometheus.log", "w") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        wait_for_port("127.0.0.1", self.port, self.process, timeout_s)
        deadline = time.monotonic() + timeout_s
        while httpx.get(f"{self.url}/-/ready", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Prometheus never became ready; see {self.folder / 'prometheus.log'}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process])
            self.process = None

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's result vector (or scalar as one element); PromQLError when it does not run."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = api_get(self.url, "query", params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str, at: float | None = None) -> float:
        """The one value `expr` gives (it must give exactly one series)."""
        result = self.query(expr, at)
        if len(result) != 1:
            raise PromQLError(f"{expr!r} gave {len(result)} series, not one: {result}")
        return float(result[0]["value"][1])

    def wait_for_scrapes_after(self, moment: float, timeout_s: float = 30.0) -> float:
        """Until every target was scraped (successfully) after the Unix time `moment`; returns the time then."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.time()
            result = self.query("up", now)
            ready = len(result) == len(self.targets) and all(
                float(r["value"][1]) == 1 for r in result
            )
            if ready:
                oldest = self.value("min(timestamp(up))", now)
                if oldest > moment:
                    return now
            if time.monotonic() > deadline:
                raise TimeoutError(f"targets not all scraped after {moment}: {result}")
            time.sleep(0.2)


def api_get(url: str, endpoint: str, params: dict) -> dict:
    """The `data` of a Prometheus HTTP API answer (`endpoint`: query, query_range); PromQLError when the query
    does not run."""
    response = httpx.get(f"{url}/api/v1/{endpoint}", params=params, timeout=30)
    body = response.json()
    if response.status_code != 200 or body.get("status") != "success":
        raise PromQLError(f"{params.get('query')!r}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query_range(url: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    """A range query's matrix: [{"metric": {...}, "values": [[unix time, "value"], ...]}, ...]."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
    return api_get(url, "query_range", params)["result"]


def finite_values(result: list[dict]) -> list[float]:
    return [v for v in (float(r["value"][1]) for r in result) if math.isfinite(v)]
