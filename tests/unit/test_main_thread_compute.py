"""The asyncio loop beside the main thread: calls run on the main thread, results and errors come back, and
SIGTERM still reaches the handler that the loop registered."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common.main_thread_compute import MainThreadExecutor, run_beside_main_thread

REPO = Path(__file__).resolve().parents[2]


def test_submitted_calls_run_on_the_main_thread_and_the_loop_runs_elsewhere():
    async def serve(executor):
        loop = asyncio.get_running_loop()
        ran_on = await loop.run_in_executor(executor, lambda: threading.current_thread().name)
        total = await loop.run_in_executor(executor, sum, [1, 2, 3])
        return ran_on, total, threading.current_thread().name

    ran_on, total, loop_thread = run_beside_main_thread(serve)
    assert ran_on == threading.main_thread().name
    assert total == 6
    assert loop_thread == "specserve-asyncio"


def test_an_error_in_a_call_reaches_its_awaiter_and_the_main_thread_goes_on():
    async def serve(executor):
        loop = asyncio.get_running_loop()
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(executor, lambda: 1 / 0)
        return await loop.run_in_executor(executor, lambda: "still serving")

    assert run_beside_main_thread(serve) == "still serving"


def test_an_error_of_the_coroutine_is_raised_on_the_main_thread():
    async def serve(executor):
        raise LookupError("failed to start")

    with pytest.raises(LookupError, match="failed to start"):
        run_beside_main_thread(serve)


def test_calls_submitted_before_shutdown_still_run():
    executor = MainThreadExecutor()
    futures = [executor.submit(lambda i=i: i * i) for i in range(3)]
    executor.shutdown()
    executor.run_until_shutdown()
    assert [f.result() for f in futures] == [0, 1, 4]
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(print)


def test_refuses_to_run_off_the_main_thread():
    errors = []

    def call():
        try:
            run_beside_main_thread(lambda executor: asyncio.sleep(0))
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


SIGTERM_SCRIPT = """
import asyncio, sys
from services.common.grpc_server import install_sigterm_handler
from services.common.main_thread_compute import run_beside_main_thread

async def serve(executor):
    stopped = asyncio.Event()
    async def stop():
        await asyncio.get_running_loop().run_in_executor(executor, lambda: None)  # the main thread still serves
        print("stopped by the handler", flush=True)
        stopped.set()
    if sys.argv[1] == "handler":
        install_sigterm_handler(stop)
    print("ready", flush=True)
    await stopped.wait()
    return 0

raise SystemExit(run_beside_main_thread(serve))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_reaches_the_handler_the_loop_installed(signum):
    process = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, "handler"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert "stopped by the handler" in stdout


def test_a_signal_with_no_handler_installed_stops_the_process_as_it_would_by_default():
    process = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, "none"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM
