"""`specserve serve` wires the three services' flags consistently: ports, speculation, metrics and TLS."""

from __future__ import annotations

import argparse

import pytest

from services import launcher


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(list(argv))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_default_plan_starts_drafter_verifier_gateway_with_their_ports():
    drafter, verifier, gateway = launcher.plan(parse())
    assert [c.name for c in (drafter, verifier, gateway)] == ["drafter", "verifier", "gateway"]
    assert (drafter.port, verifier.port, gateway.port) == (50061, 50051, 8000)
    assert flag(drafter.argv, "--metrics-port") == "8002" and flag(verifier.argv, "--metrics-port") == "8001"
    assert flag(verifier.argv, "--drafter") == "ngram=127.0.0.1:50061"
    assert flag(gateway.argv, "--verifier") == "127.0.0.1:50051"
    assert not any("tls" in arg or "cert" in arg for child in (drafter, verifier, gateway) for arg in child.argv)


def test_no_speculation_starts_no_drafter():
    children = launcher.plan(parse("--speculative-config", '{"method": "none"}'))
    assert [c.name for c in children] == ["verifier", "gateway"]
    assert "--drafter" not in children[0].argv


@pytest.mark.parametrize("root", [None, "/certs/ca.pem"])
def test_tls_reaches_every_link(root):
    argv = ["--tls-cert-file", "/certs/server.pem", "--tls-key-file", "/certs/server.key"]
    drafter, verifier, gateway = launcher.plan(parse(*argv, *(["--tls-root-cert", root] if root else [])))
    trusted = root or "/certs/server.pem"  # a self-signed certificate is its own root
    for server in (drafter, verifier):
        assert flag(server.argv, "--tls-cert-file") == "/certs/server.pem"
        assert flag(server.argv, "--tls-key-file") == "/certs/server.key"
    assert flag(verifier.argv, "--drafter-tls-root-cert") == trusted
    assert flag(gateway.argv, "--grpc-root-cert") == trusted


def test_half_a_tls_pair_is_refused():
    with pytest.raises(ValueError, match="go together"):
        launcher.plan(parse("--tls-cert-file", "/certs/server.pem"))


def test_stop_processes_terminates_then_kills_what_ignores_sigterm():
    import subprocess
    import sys

    stubborn_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    polite = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE)
    stubborn = subprocess.Popen([sys.executable, "-c", stubborn_code], stdout=subprocess.PIPE)
    for process in (polite, stubborn):
        assert process.stdout.readline() == b"ready\n"  # handlers installed before we signal
    killed = launcher.stop_processes([polite, stubborn], timeout_s=1.0)
    assert killed == [stubborn]
    assert polite.returncode == -15 and stubborn.returncode == -9
    for process in (polite, stubborn):
        process.stdout.close()
