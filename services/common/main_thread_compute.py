"""Run tensor work on the process's main thread and the asyncio loop beside it, on a thread of its own.

Why: torch's CPU intra-op pool (OpenMP) belongs to the thread that calls into it, and on some machines a worker
thread's pool is much slower than the main thread's: on a 2-core Intel Xeon (AVX-512, AMX, torch 2.13) a model
forward took 49-52 ms on a worker thread against 34.5 ms on the main thread, while on a 2-core AMD EPYC the two
are equal. A service that wants its forwards on the main thread cannot keep the asyncio loop there, so this
module swaps the two: `run_beside_main_thread` starts the loop on a thread named "specserve-asyncio" and the
main thread executes what is submitted to a `MainThreadExecutor` until the loop's coroutine returns.

Signals are delivered to the main thread only, and asyncio's `add_signal_handler` works only there; the loop
used here relays them: the main thread catches SIGTERM/SIGINT and calls the handler that the loop registered
(`install_sigterm_handler` works unchanged). A signal that arrives before any handler is registered keeps its
default effect (the process stops), as it would in a plain `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_POLL_S = 0.5  # how often the waiting main thread wakes, so a signal handler runs soon even where waits ignore it


class MainThreadExecutor(Executor):
    """An executor whose calls run on the thread that calls `run_until_shutdown` (the main thread)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable, tuple, dict] | None] = queue.SimpleQueue()
        self._shutdown = threading.Event()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        if self._shutdown.is_set():
            raise RuntimeError("cannot submit to a MainThreadExecutor after shutdown")
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops `run_until_shutdown` after the calls already submitted (or cancels them with cancel_futures)."""
        self._shutdown.set()
        self._calls.put(None)

    def run_until_shutdown(self) -> None:
        while True:
            try:
                item = self._calls.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                if self._calls.empty():
                    return
                self._calls.put(None)  # calls submitted before shutdown still run
                continue
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - the caller awaits the future and sees the error there
                future.set_exception(error)
            else:
                future.set_result(result)


class _RelayedSignalLoop(asyncio.SelectorEventLoop):
    """An event loop off the main thread whose signal handlers the main thread calls for it."""

    def __init__(self) -> None:
        super().__init__()
        self._signal_handlers_relayed: dict[int, tuple[Callable, tuple]] = {}

    def add_signal_handler(self, sig: int, callback: Callable, *args: Any) -> None:
        if sig not in RELAYED_SIGNALS:
            raise ValueError(f"only {[s.name for s in RELAYED_SIGNALS]} are relayed to this loop, not {sig}")
        self._signal_handlers_relayed[sig] = (callback, args)

    def remove_signal_handler(self, sig: int) -> bool:
        return self._signal_handlers_relayed.pop(sig, None) is not None

    def has_handler(self, sig: int) -> bool:
        return sig in self._signal_handlers_relayed

    def deliver(self, sig: int) -> None:
        """Runs on the loop: the registered handler (it may have been removed since the relay saw it)."""
        handler = self._signal_handlers_relayed.get(sig)
        if handler is not None:
            callback, args = handler
            callback(*args)


def run_beside_main_thread(make_coroutine: Callable[[Executor], Coroutine[Any, Any, Any]]) -> Any:
    """Run `make_coroutine(executor)` on an asyncio loop in a second thread while the calling (main) thread
    executes every call submitted to `executor`; return the coroutine's result or raise its error."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_beside_main_thread must be called from the main thread")
    executor = MainThreadExecutor()
    loop = _RelayedSignalLoop()
    outcome: dict[str, Any] = {}

    def run_loop() -> None:
        asyncio.set_event_loop(loop)
        try:
            outcome["result"] = loop.run_until_complete(make_coroutine(executor))
        except BaseException as error:  # noqa: BLE001 - handed to the main thread, which re-raises it
            outcome["error"] = error
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                executor.shutdown()

    def relay(signum: int, frame: object) -> None:
        """Runs on the main thread. No handler on the loop (yet, or any more): the signal's default action."""
        if loop.is_closed() or not loop.has_handler(signum):
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        try:
            loop.call_soon_threadsafe(loop.deliver, signum)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    previous = {sig: signal.signal(sig, relay) for sig in RELAYED_SIGNALS}
    loop_thread = threading.Thread(target=run_loop, name="specserve-asyncio")
    try:
        loop_thread.start()
        executor.run_until_shutdown()
        loop_thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def worker_thread() -> ThreadPoolExecutor:
    """The one worker thread that runs a process's forwards when they do not run on the main thread: one
    thread, so every step reuses one torch intra-op pool instead of waking the pools of several threads."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-engine")


def run_with_compute(
    placement: str, worker: Executor, make_coroutine: Callable[[Executor], Coroutine[Any, Any, Any]]
) -> Any:
    """Run `make_coroutine(compute)` with the forwards on the thread `placement` names ("main" or "worker"):
    the verifier service and the bench arrange their threads through this one function."""
    if placement == "main":
        return run_beside_main_thread(make_coroutine)
    return asyncio.run(make_coroutine(worker))
