"""The end-to-end rows: the whole stack as real processes, timed through the OpenAI HTTP API.

`HttpStack` starts the drafter (ngram, the bench's K and n-gram sizes), the verifier (the bench's model, device,
dtype, slots and context length) and the gateway with exactly the commands `specserve serve` runs
(`services.launcher.plan`), on free ports, each logging to a file in a temp dir, and stops them on exit.
`HttpClient.complete` sends one of the bench's token-id prompts to POST /v1/completions, non-streaming and
greedy, with speculation off or ngram K chosen per request; the bench calls it right after the in-process
engine's run of the same prompt, so the rows compare like for like: same prompts, same budgets, same EOS
handling (generation stops at EOS, no `ignore_eos`), same metric (completion tokens / wall time of the
request, here the whole HTTP round trip).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from services import launcher, supervision
from services.bench.report import Generation

__all__ = ["HttpClient", "HttpStack", "HttpTarget", "StackError", "launcher_args", "system_label"]

Progress = Callable[[str], None]
HOST = "127.0.0.1"
# Environment that would configure the children behind the bench's back (an API key the bench does not send,
# other engine limits): the stack under test is configured by the launcher's flags only.
_FOREIGN_ENV = ("SPECSERVE_VERIFIER_", "SPECSERVE_DRAFTER_", "SPECSERVE_GATEWAY_", "SPECSERVE_API_KEY")


class StackError(RuntimeError):
    """The stack did not come up (a child exited or never listened, the gateway never reported healthy)."""


@dataclass(frozen=True)
class HttpTarget:
    """What the stack serves; the same model spec, device and dtype the in-process rows loaded. `threads`:
    torch threads of the verifier (OMP_NUM_THREADS), the bench process's own count so both engines compute
    alike. `decode` turns in-process token ids into the text the gateway would return, for the equality checks."""

    model: str
    device: str
    dtype: str
    threads: int
    decode: Callable[[Sequence[int]], str]
    start_timeout_s: float = 300.0


def system_label(k: int) -> str:
    """The row's system name; K = 0 is speculation off (the gateway and the Generate link, no drafter)."""
    return f"specserve HTTP API ngram K<={k} (gateway + gRPC drafter)" if k > 0 else "specserve HTTP API off"


def free_ports(count: int) -> list[int]:
    return supervision.free_ports(count, HOST)


def launcher_args(
    target: HttpTarget, k: int, prompt_lookup_min: int, prompt_lookup_max: int, max_num_seqs: int,
    max_model_len: int, compute_thread: str = "auto",
) -> argparse.Namespace:
    """`specserve serve` flags, parsed by the launcher's own parser so any newer flag gets its default; every
    port flag it has (gateway, gRPC, metrics) gets a free port, so the bench never collides with a running
    `specserve serve` or another bench."""
    parser = argparse.ArgumentParser(add_help=False)
    launcher.add_arguments(parser)
    port_flags = [name for name in vars(parser.parse_args([])) if name == "port" or name.endswith("_port")]
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": prompt_lookup_min,
        "prompt_lookup_max": prompt_lookup_max,
    }
    argv = [
        "--model", target.model, "--device", target.device, "--dtype", target.dtype,
        "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
        "--speculative-config", json.dumps(spec), "--host", HOST,
        "--start-timeout-s", str(target.start_timeout_s), "--compute-thread", compute_thread,
    ]
    for name, port in zip(port_flags, free_ports(len(port_flags)), strict=True):
        argv += [f"--{name.replace('_', '-')}", str(port)]
    return parser.parse_args(argv)


def child_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV)}
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the files while the process runs, and survive a kill
    return env


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])


class HttpStack:
    """Drafter, verifier and gateway as child processes; a context manager that always takes them down."""

    def __init__(self, args: argparse.Namespace, threads: int, progress: Progress) -> None:
        self.args = args
        self.threads = threads
        self.progress = progress
        self.base_url = f"http://{args.host}:{args.port}"
        self.log_dir: Path | None = None
        self._children: list[tuple[supervision.Child, subprocess.Popen, IO[str]]] = []

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        self.stop(keep_logs=exc_type is not None)

    def start(self) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="specserve-bench-stack-"))
        env = child_env(self.threads)
        for child in launcher.plan(self.args):
            self.progress(f"HTTP stack: starting {child.name} on {child.host}:{child.port}")
            log_path = self.log_dir / f"{child.name}.log"
            log = open(log_path, "w")  # noqa: SIM115 -- lives as long as the process; closed in stop()
            process = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            self._children.append((child, process, log))
            try:
                supervision.wait_for_port(child.host, child.port, process, self.args.start_timeout_s)
            except (RuntimeError, TimeoutError) as error:
                raise StackError(
                    f"HTTP stack: {child.name} did not start ({error}); its log, {log_path}:\n{_tail(log_path)}"
                ) from error
        self._wait_healthy()

    def _wait_healthy(self, timeout_s: float = 60.0) -> None:
        """The gateway answers /health "ok" once the verifier is up and every drafter link is serving."""
        import httpx

        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                response = httpx.get(f"{self.base_url}/health", timeout=5, trust_env=False)
                last = response.json()
                if response.status_code == 200 and last.get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError) as error:
                last = error
            time.sleep(0.3)
        raise StackError(f"HTTP stack: not healthy after {timeout_s:.0f} s (last /health: {last}); "
                           f"logs in {self.log_dir}")

    def _check_alive(self) -> None:
        for child, process, _ in self._children:
            if process.poll() is not None:
                log_path = self.log(child.name)
                raise StackError(f"HTTP stack: {child.name} exited with code {process.returncode}; "
                                   f"its log, {log_path}:\n{_tail(log_path)}")

    def log(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.log"

    def stop(self, keep_logs: bool = False) -> None:
        """SIGTERM gateway, verifier, drafter (in that order), then SIGKILL whatever is still up after 20 s."""
        children = list(reversed(self._children))
        killed = supervision.stop_processes([process for _, process, _ in children])
        for child, process, log in children:
            if process in killed:
                self.progress(f"HTTP stack: {child.name} ignored SIGTERM; killed it")
            log.close()
        self._children.clear()
        if self.log_dir is None:
            return
        if keep_logs:
            self.progress(f"HTTP stack: logs kept in {self.log_dir}")
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)


class HttpClient:
    """A keep-alive HTTP client on the gateway, as an application would hold one."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        import httpx

        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False)
        models = self._http.get("/v1/models")
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def complete(self, prompt: Sequence[int], max_tokens: int, k: int, method: str = "ngram") -> Generation:
        """One timed, non-streaming, greedy completion of a token-id prompt with `method` at K (the stack's
        drafter must serve it); K = 0 turns speculation off.

        Engine steps are not in the response; they follow from it exactly: every step emits one token plus the
        draft tokens it accepted, so steps = completion tokens - accepted tokens."""
        speculation = {"method": method, "num_speculative_tokens": k} if k > 0 else {"method": "none"}
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "speculative_config": speculation,
        }
        started = time.perf_counter()
        response = self._http.post("/v1/completions", json=body)
        payload = response.json()
        seconds = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"POST /v1/completions answered {response.status_code}: {payload}")
        completion_tokens = payload["usage"]["completion_tokens"]
        spec = payload.get("speculative_decoding") or {}
        accepted = spec.get("num_accepted_tokens", 0)
        return Generation(
            tokens=(),
            seconds=seconds,
            num_steps=completion_tokens - accepted,
            num_drafts=spec.get("num_drafts", 0),
            num_accepted=accepted,
            text=payload["choices"][0]["text"],
            reported_tokens=completion_tokens,
        )
