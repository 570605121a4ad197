"""`specserve serve` as users run it (one launcher process, its children on free ports, output in a log file),
with its children killed under traffic: the launcher restarts each one and the stack heals without help, while
requests that were not on the dead process are unharmed and those that were end with a clear error, never a
hang. Ends with a short soak against the same stack and a SIGTERM that must stop everything."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Self

import httpx
import openai
import pytest

from services.soak.main import SoakSettings, soak
from services.soak.serve_process import ServeProcess, service_name
from services.soak.traffic import TrafficSettings
from tests.e2e.requests import CODE, EDIT, MODEL, NO_SPEC, in_background, wait_until_speculation_accepts
from tests.e2e.stack import serve_ports

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    stack = ServeProcess(tmp_path_factory.mktemp("serve") / "serve.log",
                         extra_flags=["--restart-backoff-initial-s", "0.5", "--restart-backoff-max-s", "5"],
                         ports=serve_ports())
    try:
        stack.start(timeout_s=300)
    except BaseException:
        stack.stop()
        raise
    yield stack
    stack.stop()


@pytest.fixture()
def healthy(serve):
    """Each test starts from a healthy stack (ok: the drafter attached), whatever the previous test left."""
    serve.wait_healthy(timeout_s=180)
    return serve


@pytest.fixture()
def client(healthy):
    return openai.OpenAI(base_url=f"{healthy.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def wait_for_log(serve: ServeProcess, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in serve.log():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in the launcher's output within {timeout_s:.0f} s:\n"
                                 f"{serve.log()[-3000:]}")
        time.sleep(0.2)


def kill(pid: int) -> None:
    """SIGKILL and wait until the process is gone (its sockets closed), as an OOM kill would."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while service_name(pid) is not None and time.monotonic() < deadline:  # a zombie has no cmdline
        time.sleep(0.02)


class HealthWatcher:
    """Polls /health in a thread and records every status it sees, so a short "degraded" is not missed."""

    def __init__(self, serve: ServeProcess) -> None:
        self.serve = serve
        self.statuses: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _poll(self, timeout_s: float) -> None:
        code, body = self.serve.health(timeout_s=timeout_s)
        status = body.get("status", f"http {code}")
        if not self.statuses or self.statuses[-1] != status:
            self.statuses.append(status)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll(timeout_s=2)
            time.sleep(0.1)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        """Ends with one more poll: the thread's last one may have started before the state the test waited for
        (CI once saw ['ok', 'degraded'] right after the test's own wait had seen 'ok')."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll(timeout_s=5)


def test_drafter_killed_mid_stream_costs_speed_not_correctness(healthy, client):
    messages = [{"role": "user", "content": EDIT}]
    reference = in_background(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=96,
                              temperature=0, extra_body=NO_SPEC)  # beside the stream, in the same steps
    drafter = healthy.children()["drafter"]
    received: list[str] = []
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=96,
                                                        temperature=0, stream=True):
                if chunk.choices:
                    received.append(chunk.choices[0].delta.content or "")
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            failure.append(error)

    with HealthWatcher(healthy) as watcher:
        reader = threading.Thread(target=consume)
        reader.start()
        deadline = time.monotonic() + 30
        while len(received) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        kill(drafter)  # mid-stream
        reader.join(timeout=120)
        assert not reader.is_alive() and not failure, failure
        assert "".join(received) == reference.result(timeout=120).choices[0].message.content
        wait_for_log(healthy, f"drafter (pid {drafter}) exited with code -9")
        wait_for_log(healthy, "drafter is listening again")
        healthy.wait_healthy(timeout_s=60)  # the verifier re-attached the restarted drafter by itself
    assert "degraded" in watcher.statuses and watcher.statuses[-1] == "ok", watcher.statuses
    assert healthy.children()["drafter"] != drafter
    assert wait_until_speculation_accepts(client, messages) > 0  # speculation works again, on the new drafter


async def _stream_until_error(client: openai.AsyncOpenAI, started: list[int], index: int) -> object:
    """A long stream; returns how it ended: 'completed', the SSE error body, or the HTTP status."""
    try:
        stream = await client.completions.create(model=MODEL, prompt=CODE, max_tokens=400, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            started[index] += 1
        return "completed"
    except openai.APIStatusError as error:
        return error.status_code
    except openai.APIError as error:  # an SSE error event after the 200
        return error.body


async def _plain(client: openai.AsyncOpenAI) -> object:
    try:
        await client.completions.create(model=MODEL, prompt=CODE, max_tokens=400, temperature=0,
                                        extra_body={"ignore_eos": True})
        return "completed"
    except openai.APIStatusError as error:
        return error.status_code


def test_verifier_killed_under_traffic_fails_its_requests_cleanly_and_the_stack_recovers(healthy, client):
    verifier = healthy.children()["verifier"]

    async def traffic() -> list[object]:
        aclient = openai.AsyncOpenAI(base_url=f"{healthy.base_url}/v1", api_key="unused", max_retries=0,
                                     timeout=60)
        started = [0, 0, 0]
        tasks = [asyncio.ensure_future(_stream_until_error(aclient, started, i)) for i in range(3)]
        tasks.append(asyncio.ensure_future(_plain(aclient)))
        deadline = time.monotonic() + 60
        while (min(started) < 2 or healthy.health()[1].get("num_running", 0) < 4) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert min(started) >= 2, "the streams never started"
        kill(verifier)
        try:
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)  # never a hang
        finally:
            await aclient.close()

    results = asyncio.run(traffic())
    for result in results[:3]:  # streams: an SSE error after the 200, of the 503 kind
        assert isinstance(result, dict) and result["type"] == "service_unavailable", result
    assert results[3] == 503
    # while it is away: clean 503s, quickly
    for _ in range(3):
        began = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert refused.value.status_code == 503 and time.monotonic() - began < 15
        assert refused.value.body["type"] == "service_unavailable"
        time.sleep(0.5)
    code, body = healthy.health()
    assert code == 503 and body["status"] == "unavailable"
    wait_for_log(healthy, f"verifier (pid {verifier}) exited with code -9")
    wait_for_log(healthy, "verifier is listening again", timeout_s=180)
    healthy.wait_healthy(timeout_s=120)  # the gateway reconnected by itself
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert completion.choices[0].text
    assert healthy.children()["verifier"] != verifier


def test_gateway_killed_is_restarted_and_its_requests_are_freed_on_the_verifier(healthy, client):
    gateway = healthy.children()["gateway"]
    in_flight = client.completions.create(model=MODEL, prompt=CODE, max_tokens=400, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    next(iter(in_flight))
    kill(gateway)
    with pytest.raises((openai.APIConnectionError, httpx.TransportError)):
        for _ in in_flight:
            pass
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    wait_for_log(healthy, f"gateway (pid {gateway}) exited with code -9")
    wait_for_log(healthy, "gateway is listening again")
    body = healthy.wait_healthy(timeout_s=60)
    deadline = time.monotonic() + 20  # the dead gateway's Generate call was cancelled: its slot is free again
    while body["num_running"] and time.monotonic() < deadline:
        time.sleep(0.3)
        body = healthy.health()[1]
    assert body["num_running"] == 0 and body["num_waiting"] == 0
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert completion.choices[0].text
    assert healthy.children()["gateway"] != gateway


def test_short_soak_has_no_failures(healthy):
    settings = SoakSettings(TrafficSettings(duration_s=15, concurrency=12, max_tokens=16, request_timeout_s=60),
                            warmup_s=3, drain_timeout_s=30)
    report = asyncio.run(soak(healthy.base_url, healthy.children, settings))
    assert report.failures == 0, report.failure_examples
    assert report.outcomes["ok"] > 0 and report.outcomes["clean_4xx"] + report.outcomes["cancelled"] > 0
    assert report.ttft_s.count > 0 and report.itl_s.count > 0
    assert (report.running_at_end, report.waiting_at_end) == (0, 0)
    assert [m.service for m in report.memory] == ["drafter", "verifier", "gateway"]
    assert not any(m.restarted for m in report.memory) and all(m.end_bytes for m in report.memory)


def test_sigterm_stops_every_service(serve):
    children = serve.children()
    assert serve.stop(timeout_s=60) == 0
    assert set(children) == {"drafter", "verifier", "gateway"}
    assert all(service_name(pid) is None for pid in children.values())  # none left behind
