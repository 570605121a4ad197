"""`specserve serve`: the whole stack on one machine as three child processes (drafter, verifier, gateway),
started in dependency order and stopped together.

The services are the same processes a deployment runs separately (docker-compose, Helm); this launcher only
wires their flags, waits for each to listen, prints every endpoint, and takes them all down when one exits or
when it receives SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class Child:
    name: str
    argv: list[str]
    host: str
    port: int


def wait_for_port(host: str, port: int, process: subprocess.Popen, timeout_s: float) -> None:
    """Block until something accepts connections on host:port; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with code {process.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


def stop_processes(processes: Sequence[subprocess.Popen], timeout_s: float = 20.0) -> list[subprocess.Popen]:
    """SIGTERM every process still running, in the given order (each service stops gracefully), then SIGKILL
    those still up after `timeout_s` in all. Returns the ones that had to be killed."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    killed = []
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            killed.append(process)
    return killed


@dataclass(frozen=True)
class TlsFlags:
    """One certificate for both gRPC servers (verifier, drafter) and the root their clients trust (the
    certificate itself when it is self-signed and no --tls-root-cert is given)."""

    cert_file: str | None
    key_file: str | None
    root_cert: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsFlags:
        if bool(args.tls_cert_file) != bool(args.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        root = args.tls_root_cert or args.tls_cert_file
        return cls(args.tls_cert_file, args.tls_key_file, root)

    @property
    def server_flags(self) -> list[str]:
        return ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file] if self.cert_file else []

    @property
    def drafter_client_flags(self) -> list[str]:
        return ["--drafter-tls-root-cert", self.root_cert] if self.cert_file else []

    @property
    def gateway_flags(self) -> list[str]:
        return ["--grpc-root-cert", self.root_cert] if self.cert_file else []


def plan(args: argparse.Namespace) -> list[Child]:
    """The three commands, in start order."""
    python = [sys.executable, "-m", "services.cli"]
    spec = SpeculativeConfig.parse(args.speculative_config)
    tls = TlsFlags.from_args(args)
    children = []
    verifier = [
        *python, "verifier", "--model", args.model, "--device", args.device, "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--host", args.host, "--port", str(args.verifier_port),
        "--metrics-port", str(args.verifier_metrics_port), *tls.server_flags,
    ]
    if args.max_model_len:
        verifier += ["--max-model-len", str(args.max_model_len)]
    if spec.enabled:
        verifier += ["--speculative-config", spec.model_dump_json()]
        drafter = [
            *python, "drafter", "--method", spec.method,
            "--num-speculative-tokens", str(spec.num_speculative_tokens),
            "--prompt-lookup-min", str(spec.prompt_lookup_min), "--prompt-lookup-max", str(spec.prompt_lookup_max),
            "--host", args.host, "--port", str(args.drafter_port),
            "--metrics-port", str(args.drafter_metrics_port), *tls.server_flags,
        ]
        children.append(Child("drafter", drafter, args.host, args.drafter_port))
        verifier += ["--drafter", f"{spec.method}={args.host}:{args.drafter_port}", *tls.drafter_client_flags]
    children.append(Child("verifier", verifier, args.host, args.verifier_port))
    gateway = [
        *python, "gateway", "--model", args.model, "--host", args.host, "--port", str(args.port),
        "--verifier", f"{args.host}:{args.verifier_port}", *tls.gateway_flags,
    ]
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    children.append(Child("gateway", gateway, args.host, args.port))
    return children


def run(args: argparse.Namespace) -> int:
    processes: list[tuple[Child, subprocess.Popen]] = []
    stopping = False

    def stop_all(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)
    try:
        for child in plan(args):
            print(f"starting {child.name}: {' '.join(child.argv[1:])}", flush=True)
            process = subprocess.Popen(child.argv)
            processes.append((child, process))
            wait_for_port(child.host, child.port, process, args.start_timeout_s)
        base = f"http://{args.host}:{args.port}"
        print(
            "\nspecserve is serving:\n"
            f"  POST {base}/v1/completions\n  POST {base}/v1/chat/completions\n  GET  {base}/v1/models\n"
            f"  GET  {base}/health\n  GET  {base}/metrics\n"
            f"  verifier gRPC {args.host}:{args.verifier_port}, metrics http://{args.host}:{args.verifier_metrics_port}/metrics\n"
            + (
                f"  drafter gRPC {args.host}:{args.drafter_port}, metrics http://{args.host}:{args.drafter_metrics_port}/metrics\n"
                if len(processes) == 3
                else ""
            )
            + "Ctrl-C stops everything.",
            flush=True,
        )
        while not stopping:
            for child, process in processes:
                if process.poll() is not None:
                    print(f"{child.name} exited with code {process.returncode}; stopping the stack", flush=True)
                    stopping = True
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as error:
        print(f"specserve serve: {error}", file=sys.stderr)
        return 1
    finally:
        stop_processes([process for _, process in reversed(processes)])  # gateway first, drafter last


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 5}',
        help="JSON; '{\"method\": \"none\"}' serves without speculation",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    parser.add_argument("--verifier-port", type=int, default=50051)
    parser.add_argument("--verifier-metrics-port", type=int, default=8001)
    parser.add_argument("--drafter-port", type=int, default=50061)
    parser.add_argument("--drafter-metrics-port", type=int, default=8002)
    parser.add_argument("--tls-cert-file", default=None, help="PEM certificate: the verifier and drafter serve TLS")
    parser.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    parser.add_argument("--tls-root-cert", default=None, help="PEM root the gRPC clients trust (default: the cert)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
