"""Readiness means ready: services started against an empty, read-only model cache (a container whose model
volume is mounted empty) fail their start with a message that says what to do, or, for a gateway that learns its
model from the verifier, stay up not ready with that message on /health and in 503s. Never a 500, never a fetch
in the request path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.supervision import stop_processes, wait_for_port
from tests.e2e.stack import REPO
from tests.ports import free_port

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
WHAT_TO_DO = (f"specserve fetch {MODEL}", "SPECSERVE_CACHE_DIR")


def read_only(folder: Path, command: list[str]) -> list[str]:
    """`command` run where `folder` (made empty) cannot be written: a read-only bind mount in a mount namespace
    of its own for root (whom permission bits do not stop), the permission bits otherwise. Where root may not
    mount, a folder under a regular file, which cannot be created either."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return command
    if shutil.which("unshare") and subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0:
        mount = 'mount --bind -o ro "$0" "$0" && exec "$@"'
        return ["unshare", "--mount", "sh", "-c", mount, str(folder), *command]
    folder.rmdir()
    folder.parent.joinpath(folder.name).write_text("")  # a file where the cache's model folders would go
    return command


def specserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def env_with_cache(folder: Path) -> dict[str, str]:
    return {**os.environ, "SPECSERVE_CACHE_DIR": str(folder / "models" if folder.is_file() else folder)}


@pytest.mark.parametrize("service", ["verifier", "gateway"])
def test_a_service_whose_model_is_missing_from_a_read_only_cache_exits_with_what_to_do(tmp_path, service):
    cache = tmp_path / "cache"
    args = ["--port", "0", "--metrics-port", "0"] if service == "verifier" else ["--port", str(free_port())]
    command = read_only(cache, specserve(service, "--model", MODEL, *args))
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env_with_cache(cache), capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"specserve {service}: error: model {MODEL!r} is not in the cache folder")
    assert all(hint in message for hint in WHAT_TO_DO) and "Traceback" not in result.stderr
    assert seconds < 30, f"{service} took {seconds:.1f} s to give up"  # the 10 s on a quiet machine


def test_a_gateway_that_cannot_load_the_verifiers_tokenizer_stays_up_not_ready_with_503s(tmp_path, shared_stack):
    """No --model: the gateway learns the model from the verifier (the shared stack's), then cannot load its
    tokenizer from an empty read-only cache. It stays up; /health and requests say why with 503s."""
    cache = tmp_path / "cache"
    port = free_port()
    command = read_only(cache, specserve("gateway", "--port", str(port),
                                         "--verifier", f"127.0.0.1:{shared_stack.verifier_port}"))
    log = (tmp_path / "gateway.log").open("w")
    process = subprocess.Popen(command, cwd=REPO, env=env_with_cache(cache), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, process, 60)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{base}/health", timeout=10)).json().get("status") == "starting":
            assert time.monotonic() < deadline, health.json()
            time.sleep(0.2)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert all(hint in health.json()["error"] for hint in WHAT_TO_DO)
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}),
                           ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "Hi"}]})):
            response = httpx.post(f"{base}{path}", json=body, timeout=30)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "model_unavailable" and all(hint in error["message"] for hint in WHAT_TO_DO)
        assert process.poll() is None
    finally:
        stop_processes([process])
        log.close()
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()
