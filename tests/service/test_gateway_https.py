"""HTTPS on the gateway (vLLM's --ssl-keyfile and --ssl-certfile): `specserve gateway` as its own process serves the
API over TLS to clients that trust its certificate; plaintext HTTP and clients trusting another certificate are
turned away; a key that cannot be read, or is not the certificate's, fails the start naming it."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys

import httpx
import pytest

from services.supervision import free_ports, wait_for_port
from tests.tls_certs import write_self_signed


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("https")
    return write_self_signed(folder / "good"), write_self_signed(folder / "other")


def _gateway(port: int, *flags: str) -> subprocess.Popen:
    """A gateway whose verifier is nowhere (its /version needs none)."""
    env = {**os.environ, "SPECSERVE_GATEWAY_INFO_TIMEOUT_S": "1"}
    return subprocess.Popen([sys.executable, "-m", "services.cli", "gateway", "--port", str(port), "--verifier",
                             "127.0.0.1:1", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.fixture(scope="module")
def https_gateway(certs):
    good, _ = certs
    (port,) = free_ports(1)
    process = _gateway(port, "--ssl-keyfile", str(good.key), "--ssl-certfile", str(good.cert))
    try:
        wait_for_port("127.0.0.1", port, process, timeout_s=60)
        yield port
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_the_api_is_served_over_https_to_a_client_that_trusts_the_certificate(certs, https_gateway):
    good, _ = certs
    with httpx.Client(verify=ssl.create_default_context(cafile=good.cert), timeout=10) as client:
        assert client.get(f"https://localhost:{https_gateway}/version").json()["version"]
        health = client.get(f"https://127.0.0.1:{https_gateway}/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"  # no verifier: said over TLS


def test_plain_http_and_a_client_trusting_another_certificate_are_turned_away(certs, https_gateway):
    _, other = certs
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{https_gateway}/version", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://localhost:{https_gateway}/version", verify=ssl.create_default_context(cafile=other.cert),
                  timeout=10)


@pytest.mark.parametrize(("flags", "says"), [
    (["--ssl-keyfile", "/nonexistent/server.key", "--ssl-certfile", "CERT"],
     "/nonexistent/server.key is not a readable"),
    (["--ssl-certfile", "CERT"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "CERT", "--ssl-certfile", "CERT"], "are not a PEM certificate and its unencrypted private key"),
])
def test_a_missing_key_fails_the_start_saying_so(certs, flags, says):
    good, _ = certs
    (port,) = free_ports(1)
    process = _gateway(port, *[str(good.cert) if flag == "CERT" else flag for flag in flags])
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0 and says in output
