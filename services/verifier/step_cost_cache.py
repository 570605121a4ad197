"""The start-up step-cost profile, kept on disk and reused by the next start on the same machine and setup.

Why: the profile (step_cost.py) times ~70 verify forwards; for SmolLM2-135M on 2 CPU cores that is ~15 s, most
of a verifier's start once its model loads in about a second. A verifier that restarts (after a crash, a
rollout, a test) on the same hardware with the same model, runner kernels and thread count would measure the
same costs again. So the profile's samples are written to a file named by everything they depend on, and a
start that finds a fresh file (at most MAX_AGE_S old) loads them instead of measuring. The engine refines the
costs online from every step either way, so a stale figure is outvoted by the steps it times.

The identity leaves out the CPU kernels the runner chose per shape (kernel_choice.py): they are remeasured at
every start and a near-tie can flip under load, which would make most restarts miss while changing a cost by a
few percent; the machine, model, dtype, threads and slots decide the profile's shape.

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

import torch

from services.modeling.runner import ModelRunner
from services.verifier.step_cost import PROFILE_CONTEXT, PROFILE_REPEATS, StepCostModel

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


@dataclass(frozen=True)
class StepCostCache:
    """Where profiles are kept, and the facts of the model being served that the engine cannot see (its runner
    knows slots and device, not the weights' identity or the thread the forwards were placed on)."""

    directory: Path
    model_id: str
    model_config: str  # the model's config as JSON: another revision or size of the same name is another profile
    dtype: str
    compute_thread: str

    def identity(self, runner: ModelRunner, max_rows: int, max_width: int) -> dict[str, object]:
        """Everything a profile's timings depend on. Two starts with equal identities reuse one profile."""
        device = runner.device
        hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
        return {
            "format": FORMAT,
            "model": self.model_id,
            "model_config_sha256": hashlib.sha256(self.model_config.encode()).hexdigest(),
            "dtype": self.dtype,
            "device": str(device),
            "hardware": hardware,
            "usable_cores": _usable_cores(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "compute_thread": self.compute_thread,
            "max_rows": max_rows,
            "max_width": max_width,
            "profile": [PROFILE_CONTEXT, PROFILE_REPEATS],
        }

    def path(self, identity: dict[str, object]) -> Path:
        return profile_path(self.directory, identity)


def profile_path(directory: Path, identity: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    return directory / f"step-cost-{digest}.json"


def load_profile(path: Path, identity: dict[str, object], model: StepCostModel, now: float | None = None) -> bool:
    """Load a stored profile into `model` (and fit it) if `path` holds one for exactly `identity`, younger than
    MAX_AGE_S. False (model untouched) otherwise."""
    try:
        stored = json.loads(path.read_text())
        if stored.get("identity") != identity:
            return False
        age = (time.time() if now is None else now) - float(stored["measured_at"])
        if not 0 <= age <= MAX_AGE_S:
            return False
        samples = [(int(s["rows"]), int(s["width"]), int(s["span"]), [float(x) for x in s["seconds"]])
                   for s in stored["samples"]]
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring the stored step-cost profile %s (%s); measuring", path, error)
        return False
    model.restore(samples)
    if not model.fitted:
        return False
    logger.info("step-cost profile reused from %s (measured %.1f h ago): %s", path, age / 3600, model.describe())
    return True


def save_profile(path: Path, identity: dict[str, object], model: StepCostModel) -> None:
    """Write the profile atomically (a concurrent start reads the old file or the new one, never half of one).
    A folder that cannot be written only costs the next start its measurement."""
    record = {
        "identity": identity,
        "measured_at": time.time(),
        "samples": [{"rows": r, "width": w, "span": s, "seconds": seconds} for r, w, s, seconds in model.samples()],
    }
    temporary: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            temporary = f.name
            json.dump(record, f, indent=1)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        logger.warning("could not store the step-cost profile in %s (%s); the next start measures again",
                       path.parent, error)
