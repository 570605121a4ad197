"""Exec shim for `specserve serve`'s children: ask the kernel to SIGTERM this process when the launcher dies, then
exec the real command in its place (same pid, so exit codes and signals reach the supervisor unchanged).

Why a shim and not `Popen(preexec_fn=...)`: a preexec_fn makes subprocess fork() the launcher and run Python in
the child before exec, and with gRPC threads alive in the parent, gRPC's fork handlers crash that child now and
then (SIGSEGV/SIGABRT before exec: one spawn in seven in a test process). Without a preexec_fn, subprocess uses
vfork+exec, which runs no fork handlers. PR_SET_PDEATHSIG survives execve for ordinary (non-setuid) programs.

With `--cpus 0,1` it also pins itself to those CPUs before exec (the affinity survives execve), so the program
and every thread it starts run there; torch sizes its thread pool from that set.

Usage: python die_with_parent.py <launcher pid> [--cpus LIST] <program> [args...]. Standard library only, run by
file path, so it needs neither the project installed nor anything imported.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_GONE_EXIT_CODE = 143  # as if the SIGTERM had arrived: 128 + 15


def main(argv: list[str]) -> None:
    launcher_pid, command = int(argv[0]), argv[1:]
    if command[:1] == ["--cpus"]:
        os.sched_setaffinity(0, {int(cpu) for cpu in command[1].split(",")})
        command = command[2:]
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect: no signal will come
            raise SystemExit(PARENT_GONE_EXIT_CODE)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
