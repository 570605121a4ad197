"""Start-up measurements kept on disk, reused by the next verifier start on the same machine and setup.

Why: before it serves, a verifier measures things that depend only on the machine and what it runs: which thread
should run the forwards (compute_placement.py, ~3.5 s for SmolLM2-135M on 2 CPU cores) and what verify forwards of
each shape cost (step_cost.py, ~15 s), most of a start once the model loads in about a second. A verifier that
restarts (a crash, a rollout, a test) on the same hardware with the same model, dtype and thread count would
measure the same again. So each result is written to a file named by a hash of everything it depends on (its
identity, kept in the file too), and a start that finds a file with the same identity, at most MAX_AGE_S old,
uses it instead of measuring. What is measured online refines it either way (the step costs are refitted from
every step served).

Anything unreadable, mismatched or unwritable means "measure", never a failed start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT = 1
MAX_AGE_S = 7 * 24 * 3600  # a week: drift (a kernel update, a BIOS setting) is caught without a version bump


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def setup_identity(model_id: str, model_config: str, dtype: str, device: torch.device) -> dict[str, Any]:
    """The machine and what runs on it: the part of every measurement's identity that all of them share.

    It leaves out the CPU kernels the runner chose per shape (kernel_choice.py): they are remeasured at every
    start and a near-tie can flip under load, which would make most restarts miss while changing a cost by a few
    percent."""
    return {
        "format": FORMAT,
        "model": model_id,
        "model_config_sha256": hashlib.sha256(model_config.encode()).hexdigest(),
        "dtype": dtype,
        "device": str(device),
        "hardware": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
        "usable_cores": _usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


@dataclass(frozen=True)
class MeasurementStore:
    directory: Path

    def path(self, kind: str, identity: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        return self.directory / f"{kind}-{digest}.json"

    def load(self, kind: str, identity: dict[str, Any], now: float | None = None) -> tuple[Any, float] | None:
        """(the stored result, its age in seconds) if a file holds one for exactly `identity`, younger than
        MAX_AGE_S; else None."""
        path = self.path(kind, identity)
        try:
            stored = json.loads(path.read_text())
            if stored.get("identity") != identity:
                return None
            age = (time.time() if now is None else now) - float(stored["measured_at"])
            return (stored["result"], age) if 0 <= age <= MAX_AGE_S else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            logger.warning("ignoring the stored %s measurement %s (%s); measuring", kind, path, error)
            return None

    def save(self, kind: str, identity: dict[str, Any], result: Any) -> None:
        """Write atomically (a concurrent start reads the old file or the new one, never half of one). A folder
        that cannot be written only costs the next start its measurement."""
        path = self.path(kind, identity)
        record = {"identity": identity, "measured_at": time.time(), "result": result}
        temporary: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                             delete=False) as f:
                temporary = f.name
                json.dump(record, f, indent=1)
            os.replace(temporary, path)
        except OSError as error:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            logger.warning("could not store the %s measurement in %s (%s); the next start measures again",
                           kind, path.parent, error)
