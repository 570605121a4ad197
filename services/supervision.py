"""Child processes of `specserve serve`: start one, wait until it listens, supervise it, stop a group in order.

Supervision is what a process manager does: a child that dies is restarted with the very same argv (same ports)
after an exponential backoff, so one crash costs the requests that were on that process and nothing else. The
pieces are kept apart from the stack's wiring (launcher.py) and take their clock, spawner and port probe as
arguments, so the restart logic is tested without processes or sleeping.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Child:
    name: str
    argv: list[str]
    host: str
    port: int
    cpus: tuple[int, ...] = ()  # the CPUs it may run on (its torch threads follow); empty: the launcher's
    env: tuple[tuple[str, str], ...] = ()  # variables it gets beside the launcher's environment


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """taskset's list syntax ("0-3,6") as sorted CPU numbers; ValueError for anything else, or for CPUs this
    process may not run on (a child can only be placed within the launcher's own set)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (e.g. 0-3,6)")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{part.strip()!r}: the range runs backwards")
        cpus.update(range(low, high + 1))
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("placing services on CPUs needs Linux (sched_setaffinity)")
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"CPUs {sorted(cpus - allowed)} are not available here (this process may use "
                         f"{format_cpu_list(allowed)})")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Sequence[int] | set[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


class StartInterrupted(Exception):
    """SIGINT/SIGTERM arrived while the stack was still starting."""


def port_is_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on host:port right now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False



def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct ports nothing listens on now (all sockets held until every port is picked); a server started
    soon after binds one of them."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind `port` on `host` now. Bound as the servers bind (SO_REUSEADDR), so a port a
    stopped server left in TIME_WAIT counts as free; an address that is not this machine's counts as taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


CPUCLOCK_SCHED = 2  # a Linux process CPU clock's id: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED), posix-timers.h


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used so far, all its threads (exited ones too), to the
    nanosecond; None where it cannot be read (the process is gone).

    Linux's per-process CPU clock (what clock_getcpuclockid(3) returns; Python does not wrap that call) rather
    than /proc/PID/stat, which counts in clock ticks (10 ms): a short measured stretch could read 0 there."""
    try:
        return time.clock_gettime(((~pid) << 3) | CPUCLOCK_SCHED)
    except OSError:
        return None


def wait_for_port(host: str, port: int, process: subprocess.Popen, timeout_s: float,
                  cancelled: Callable[[], bool] = lambda: False, while_busy: bool = False) -> None:
    """Block until something accepts connections on host:port; fail early if the process died, and give up at
    once when `cancelled()` turns true (a Ctrl-C during a long model load must not wait for it). With
    `while_busy`, `timeout_s` counts from the last time the process was seen working (its CPU time grew): a
    large model that loads and measures for minutes is waited for, a process stuck doing nothing is not."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_seconds(process.pid) if while_busy else None
    while time.monotonic() < deadline:
        if cancelled():
            raise StartInterrupted(f"stopped while waiting for {host}:{port}")
        if process.poll() is not None:
            raise RuntimeError(f"process exited with code {process.returncode} before listening on {host}:{port}")
        if port_is_open(host, port):
            return
        time.sleep(0.2)
        if busy is not None:
            now = cpu_seconds(process.pid)
            if now is not None and now > busy + 0.1:
                busy, deadline = now, time.monotonic() + timeout_s
    idle = " idle" if while_busy else ""
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s{idle}")


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


class ChildProcess(Protocol):
    """What supervision needs of a process (subprocess.Popen, or a fake in tests)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a child that died: after `initial_backoff_s`, doubling with every crash in a row up to
    `max_backoff_s`. A child that stayed up `reset_after_s` before dying counts as healthy again (its next
    backoff is the initial one), so a rare crash is retried at once while a crash loop neither spins the CPU
    nor floods the log. There is no give-up: a service that keeps crashing keeps being retried at the cap,
    because a launcher that silently stops restarting leaves a stack that looks up and is not."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("restart backoff: need 0 < initial <= max")
        if self.reset_after_s < 0:
            raise ValueError("restart backoff: the reset time cannot be negative")

    def backoff_s(self, crashes_in_a_row: int) -> float:
        """Delay before restarting after the `crashes_in_a_row`-th consecutive crash (1-based)."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2.0 ** max(0, crashes_in_a_row - 1))

    def crashes_in_a_row(self, previous: int, uptime_s: float) -> int:
        """The consecutive-crash count after a crash that ended `uptime_s` of life."""
        return 1 if uptime_s >= self.reset_after_s else previous + 1


@dataclass
class Supervised:
    """One child under supervision: its current process and its restart history."""

    child: Child
    process: ChildProcess
    started_at: float
    restarts: int = 0
    crashes_in_a_row: int = 0
    restart_at: float | None = None  # set while the child is down, waiting for its backoff
    listening: bool = True  # false from a restart until the child accepts connections again


@dataclass
class Supervisor:
    """Restarts children that die, by `policy`; advanced by `tick()`, which never blocks longer than one port
    probe. The clock, the way to start a process and the port probe are injected so the restart logic can be
    tested without processes or sleeping."""

    policy: RestartPolicy
    spawn: Callable[[Child], ChildProcess]
    clock: Callable[[], float] = time.monotonic
    is_listening: Callable[[str, int], bool] = port_is_open
    log: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    children: list[Supervised] = field(default_factory=list)

    def adopt(self, child: Child, process: ChildProcess) -> None:
        """Supervise a child that start-up has already seen listening."""
        self.children.append(Supervised(child, process, started_at=self.clock()))

    def tick(self) -> None:
        """Notice deaths, restart children whose backoff is over, and announce restarted children that listen
        again."""
        for entry in self.children:
            if entry.restart_at is not None:
                if self.clock() >= entry.restart_at:
                    self._restart(entry)
            elif entry.process.poll() is not None:
                self._schedule_restart(entry)
            elif not entry.listening and self.is_listening(entry.child.host, entry.child.port):
                entry.listening = True
                self.log(f"{entry.child.name} is listening again on {entry.child.host}:{entry.child.port} "
                         f"(pid {entry.process.pid}, restart {entry.restarts})")

    def _schedule_restart(self, entry: Supervised) -> None:
        now = self.clock()
        uptime = now - entry.started_at
        entry.crashes_in_a_row = self.policy.crashes_in_a_row(entry.crashes_in_a_row, uptime)
        delay = self.policy.backoff_s(entry.crashes_in_a_row)
        entry.restart_at = now + delay
        self.log(f"{entry.child.name} (pid {entry.process.pid}) exited with code {entry.process.returncode} "
                 f"after {uptime:.1f} s; restarting it in {delay:.1f} s "
                 f"(restart {entry.restarts + 1}, crash {entry.crashes_in_a_row} in a row)")

    def _restart(self, entry: Supervised) -> None:
        try:
            process = self.spawn(entry.child)
        except OSError as error:  # no memory, no pids, a vanished interpreter: retried like a crash
            entry.crashes_in_a_row += 1
            delay = self.policy.backoff_s(entry.crashes_in_a_row)
            entry.restart_at = self.clock() + delay
            self.log(f"could not restart {entry.child.name} ({error}); retrying in {delay:.1f} s")
            return
        entry.process = process
        entry.started_at = self.clock()
        entry.restart_at = None
        entry.restarts += 1
        entry.listening = False
        self.log(f"restarted {entry.child.name}: pid {entry.process.pid} (restart {entry.restarts})")

    @property
    def processes(self) -> list[ChildProcess]:
        """The current process of every child, in start order."""
        return [entry.process for entry in self.children]

    @property
    def restarts(self) -> dict[str, int]:
        return {entry.child.name: entry.restarts for entry in self.children}


DIE_WITH_PARENT_SHIM = Path(__file__).with_name("die_with_parent.py")


def spawn_child(child: Child) -> subprocess.Popen:
    """Children share the launcher's stdout/stderr, so one terminal (or one log file) shows the whole stack.

    On Linux each child starts through die_with_parent.py, which sets PR_SET_PDEATHSIG and execs the real argv:
    when the launcher dies without stopping its children (SIGKILL, OOM killer), the kernel sends each SIGTERM, so
    no orphan keeps the stack's ports or memory. The shim module says why this is not a preexec_fn. The shim also
    pins a child to its `cpus`, before exec, so every thread the program starts runs there."""
    argv = child.argv
    if sys.platform == "linux":
        placement = ["--cpus", format_cpu_list(child.cpus)] if child.cpus else []
        argv = [sys.executable, str(DIE_WITH_PARENT_SHIM), str(os.getpid()), *placement, *argv]
    return subprocess.Popen(argv, env={**os.environ, **dict(child.env)} if child.env else None)
