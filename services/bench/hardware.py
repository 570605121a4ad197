"""What the benchmark ran on, printed at the top of its report, so figures from two machines can be told apart.

The same code can be 1.6x faster than transformers on one x86 CPU and 0.6x on another (AVX-512 and AMX change
which kernels win, and torch's thread pools behave differently): a table without the CPU model, its relevant
instruction sets and torch's thread settings cannot be compared with another.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# Instruction sets that decide which CPU kernels are fastest for fp32/bf16 matmuls.
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OPENBLAS_CORETYPE")


def cpu_info(cpuinfo: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(model name, the RELEVANT_FLAGS it has) from /proc/cpuinfo; platform's names where there is none."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.exists() else ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    model = model or platform.processor() or platform.machine()
    return model, tuple(flag for flag in RELEVANT_FLAGS if flag in flags)


def describe_hardware() -> dict[str, str]:
    """Report header lines: the CPU, torch's threads and libraries (the kernels the engine's runner chose are
    added by run_benchmark)."""
    model, flags = cpu_info()
    env = ", ".join(f"{name}={os.environ[name]}" for name in THREAD_ENV if name in os.environ) or "none set"
    lines = {
        "cpu": f"{model}; {', '.join(flags) or 'none of ' + '/'.join(RELEVANT_FLAGS)}",
        "torch threads": f"intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}; "
        f"thread environment: {env}; oneDNN {'available' if torch.backends.mkldnn.is_available() else 'absent'}",
    }
    if torch.cuda.is_available():
        lines["gpu"] = torch.cuda.get_device_name(0)
    return lines
