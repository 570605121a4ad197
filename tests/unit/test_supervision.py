"""Supervision of `specserve serve`'s children: restart with backoff, stop in order, die with the launcher."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services import supervision

REPO = Path(__file__).resolve().parents[2]


def test_stop_processes_terminates_then_kills_what_ignores_sigterm():
    import subprocess
    import sys

    stubborn_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    polite = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE)
    stubborn = subprocess.Popen([sys.executable, "-c", stubborn_code], stdout=subprocess.PIPE)
    for process in (polite, stubborn):
        assert process.stdout.readline() == b"ready\n"  # handlers installed before we signal
    killed = supervision.stop_processes([polite, stubborn], timeout_s=1.0)
    assert killed == [stubborn]
    assert polite.returncode == -15 and stubborn.returncode == -9
    for process in (polite, stubborn):
        process.stdout.close()


# --- supervision -------------------------------------------------------------------------------------------


@dataclass
class FakeProcess:
    """A process whose death the test decides."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class FakeWorld:
    """A clock the test moves, processes it kills, ports it opens: everything the Supervisor observes."""

    now: float = 0.0
    spawned: list[FakeProcess] = field(default_factory=list)
    open_ports: set[int] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)

    def spawn(self, child: supervision.Child) -> FakeProcess:
        self.spawned.append(FakeProcess(pid=1000 + len(self.spawned)))
        return self.spawned[-1]

    def supervisor(self, policy: supervision.RestartPolicy, *names: str) -> supervision.Supervisor:
        supervisor = supervision.Supervisor(policy, self.spawn, clock=lambda: self.now,
                                         is_listening=lambda host, port: port in self.open_ports,
                                         log=self.lines.append)
        for port, name in enumerate(names, start=1):
            supervisor.adopt(supervision.Child(name, [name], "127.0.0.1", port), self.spawn(None))
            self.open_ports.add(port)
        return supervisor

    def advance(self, supervisor: supervision.Supervisor, seconds: float, step: float = 0.1) -> None:
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = round(self.now + step, 6)
            supervisor.tick()


def test_restart_policy_doubles_to_the_cap_and_resets_after_a_long_life():
    policy = supervision.RestartPolicy(initial_backoff_s=0.5, max_backoff_s=10.0, reset_after_s=60.0)
    assert [policy.backoff_s(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.crashes_in_a_row(previous=5, uptime_s=3.0) == 6
    assert policy.crashes_in_a_row(previous=5, uptime_s=60.0) == 1
    with pytest.raises(ValueError):
        supervision.RestartPolicy(initial_backoff_s=20.0, max_backoff_s=10.0)


def test_a_dead_child_is_restarted_after_the_backoff_and_announced_when_it_listens():
    world = FakeWorld()
    supervisor = world.supervisor(supervision.RestartPolicy(), "drafter", "verifier", "gateway")
    drafter = world.spawned[0]
    world.advance(supervisor, 5.0)
    drafter.returncode = -9
    world.open_ports.discard(1)
    world.advance(supervisor, 0.1)
    assert world.lines[-1].startswith("drafter (pid 1000) exited with code -9 after 5.1 s; restarting it in 0.5 s")
    world.advance(supervisor, 0.3)
    assert len(world.spawned) == 3  # still backing off
    world.advance(supervisor, 0.2)
    assert len(world.spawned) == 4 and supervisor.processes[0] is world.spawned[3]
    assert world.lines[-1] == "restarted drafter: pid 1003 (restart 1)"
    world.advance(supervisor, 1.0)
    assert not any("listening again" in line for line in world.lines)  # not before its port opens
    world.open_ports.add(1)
    world.advance(supervisor, 0.1)
    assert world.lines[-1] == "drafter is listening again on 127.0.0.1:1 (pid 1003, restart 1)"
    assert supervisor.restarts == {"drafter": 1, "verifier": 0, "gateway": 0}
    assert supervisor.processes[1:] == world.spawned[1:3]  # the others were left alone


def test_a_crash_loop_backs_off_exponentially_to_the_cap_and_never_gives_up():
    world = FakeWorld()
    policy = supervision.RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, reset_after_s=60.0)
    supervisor = world.supervisor(policy, "verifier")
    world.advance(supervisor, 100.0)  # a long healthy life first: the loop starts at the initial backoff
    spawn_times = []
    for _ in range(7):
        supervisor.processes[0].returncode = 1  # dies at once, every time
        before = len(world.spawned)
        while len(world.spawned) == before:
            world.advance(supervisor, 0.1)
        spawn_times.append(world.now)
    gaps = [round(b - a, 1) for a, b in itertools.pairwise(spawn_times)]
    # each gap = one tick to notice the death + the backoff
    assert gaps == [1.1, 2.1, 4.1, 4.1, 4.1, 4.1]
    assert supervisor.restarts == {"verifier": 7}
    assert "crash 7 in a row" in [line for line in world.lines if "exited" in line][-1]


def test_a_child_that_stays_up_long_enough_starts_over_at_the_initial_backoff():
    world = FakeWorld()
    policy = supervision.RestartPolicy(initial_backoff_s=0.5, max_backoff_s=8.0, reset_after_s=30.0)
    supervisor = world.supervisor(policy, "gateway")
    for _ in range(3):  # three quick crashes: backoff 0.5, 1, 2
        supervisor.processes[0].returncode = 1
        world.advance(supervisor, 3.0)
    assert "restarting it in 2.0 s" in world.lines[-3]
    world.advance(supervisor, 30.0)
    supervisor.processes[0].returncode = -11
    world.advance(supervisor, 0.1)
    assert "restarting it in 0.5 s (restart 4, crash 1 in a row)" in world.lines[-1]


def test_a_restart_that_cannot_spawn_is_retried_with_backoff():
    world = FakeWorld()
    supervisor = world.supervisor(supervision.RestartPolicy(initial_backoff_s=0.5, max_backoff_s=10.0), "drafter")
    working_spawn, failures = supervisor.spawn, [OSError(12, "Cannot allocate memory")] * 2

    def flaky_spawn(child: supervision.Child) -> FakeProcess:
        if failures:
            raise failures.pop()
        return working_spawn(child)

    supervisor.spawn = flaky_spawn
    supervisor.processes[0].returncode = -9
    world.advance(supervisor, 0.7)
    assert "could not restart drafter ([Errno 12] Cannot allocate memory); retrying in 1.0 s" in world.lines[-1]
    world.advance(supervisor, 1.0)
    assert "retrying in 2.0 s" in world.lines[-1]
    world.advance(supervisor, 2.0)
    assert "restarted drafter: pid 1001 (restart 1)" in world.lines and supervisor.restarts == {"drafter": 1}


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_children_stop_when_the_launcher_is_killed_without_a_chance_to_stop_them(tmp_path):
    """SIGKILL of `specserve serve` used to leave its services running and holding their ports."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import sys, time\n"
        "from services.supervision import Child, spawn_child\n"
        "child = spawn_child(Child('sleeper', [sys.executable, '-c', 'import time; time.sleep(60)'], '127.0.0.1', 0))\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None, "the child was not started"
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        assert Path(f"/proc/{child_pid}").exists()
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child_pid):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan's zombie lingers until init reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow  # real child processes of a launcher
def test_children_start_cleanly_while_grpc_threads_are_busy_in_the_launcher():
    """A preexec_fn made subprocess fork() with gRPC threads alive, and gRPC's fork handlers crashed about one
    child in seven before exec (exit -11 or -6 instead of the child's own code). The exec shim avoids fork."""
    import threading
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()

    def keep_grpc_busy():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call_nothing = channel.unary_unary("/nothing.Here/Call")
            while not stop.is_set():
                try:
                    call_nothing(b"", timeout=1)
                except grpc.RpcError:  # UNIMPLEMENTED: the point is gRPC's threads at work, not the answer
                    pass

    threads = [threading.Thread(target=keep_grpc_busy, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        child = supervision.Child("exits-with-3", [sys.executable, "-c", "raise SystemExit(3)"], "127.0.0.1", 0)
        codes = [supervision.spawn_child(child).wait() for _ in range(40)]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        server.stop(grace=None)
    assert codes == [3] * 40


def test_the_start_wait_counts_from_the_last_work_so_a_long_load_is_waited_for_and_a_stuck_one_is_not():
    """A child that computes for 1.5 s before listening outlasts a 0.5 s timeout only when the timeout counts from
    its last CPU use (the launcher's while_busy); one that sleeps without listening fails after the timeout."""
    port = supervision.free_ports(1)[0]
    busy_then_listen = (
        "import socket, time\n"
        "end = time.monotonic() + 1.5\n"
        "while time.monotonic() < end: sum(range(10000))\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(30)\n"
    )
    for while_busy, script in ((True, busy_then_listen), (False, busy_then_listen), (True, "import time; time.sleep(30)")):
        process = subprocess.Popen([sys.executable, "-c", script])
        started = time.monotonic()
        try:
            if while_busy and script == busy_then_listen:
                supervision.wait_for_port("127.0.0.1", port, process, 0.5, while_busy=True)
                assert time.monotonic() - started > 1.4
            else:
                with pytest.raises(TimeoutError, match="after 0.5 s"):
                    supervision.wait_for_port("127.0.0.1", port, process, 0.5, while_busy=while_busy)
                assert time.monotonic() - started < 1.4
        finally:
            supervision.stop_processes([process])


def test_cpu_seconds_counts_every_thread_of_another_process_below_a_clock_tick():
    """A child whose second thread computes for 30 ms and exits, then sleeps: cpu_seconds reads all of it, though
    30 ms is 3 clock ticks and a thread that is gone (what /proc/PID/stat would round, and a main-thread-only clock
    would miss); the reading stays put while the child sleeps, and a process that is gone reads None."""
    script = ("import threading, time\n"
              "def spin():\n"
              "    end = time.thread_time() + 0.03\n"
              "    while time.thread_time() < end: pass\n"
              "t = threading.Thread(target=spin); t.start(); t.join()\n"
              "print('spun', flush=True); time.sleep(30)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert process.stdout.readline() == b"spun\n"
        used = supervision.cpu_seconds(process.pid)
        assert 0.03 <= used < 2.0
        time.sleep(0.05)
        assert supervision.cpu_seconds(process.pid) - used < 0.01
    finally:
        supervision.stop_processes([process])
    assert supervision.cpu_seconds(process.pid) is None


def test_a_child_gets_its_own_variables_beside_the_launchers_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_TEST_INHERITED", "kept")
    out = tmp_path / "env.json"
    code = ("import json, os, sys; json.dump([os.environ.get('SPECSERVE_TEST_OWN'), "
            "os.environ.get('SPECSERVE_TEST_INHERITED')], open(sys.argv[1], 'w'))")
    child = supervision.Child("env", [sys.executable, "-c", code, str(out)], "127.0.0.1", 0,
                              env=(("SPECSERVE_TEST_OWN", "mine"),))
    assert supervision.spawn_child(child).wait(timeout=60) == 0
    assert json.loads(out.read_text()) == ["mine", "kept"]
