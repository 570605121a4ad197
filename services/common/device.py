"""Turn the `--device` / `--dtype` flags into torch objects, failing early and clearly.

Every service takes `--device auto|cpu|cuda|npu` and `--dtype auto|float32|bfloat16|float16`. Resolving them
in one place means a misconfigured deployment dies at startup with a message that says what to install or
change, instead of deep inside the first forward pass.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import MappingProxyType, ModuleType

import torch

from services.common.startup_errors import DeviceUnavailableError

logger = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")

_DTYPE_ALIASES = MappingProxyType(
    {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
)


def _import_torch_npu() -> ModuleType:
    """Importing torch_npu registers the `npu` device type with torch; without it torch cannot see NPUs."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise DeviceUnavailableError(
            "device 'npu' needs the Ascend torch plugin: `pip install torch_npu` (a version matching "
            f"torch {torch.__version__}) and the CANN toolkit; torch_npu could not be imported ({exc})"
        ) from exc


def _npu_available() -> bool:
    """Probe for NPUs without importing torch_npu when it is not installed (auto must never fail)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        _import_torch_npu()
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:  # a broken CANN install must not stop `auto` from falling back to CPU
        logger.warning("torch_npu is installed but unusable; not selecting npu", exc_info=True)
        return False


def _check_index(kind: str, index: int | None, count: int) -> None:
    if index is not None and not 0 <= index < count:
        raise DeviceUnavailableError(f"device '{kind}:{index}' requested but only {count} {kind} device(s) are visible")


def resolve_device(name: str | torch.device) -> torch.device:
    """Map a device flag (`auto`, `cpu`, `cuda`, `cuda:1`, `npu`, `npu:0`) to an available torch device."""
    if isinstance(name, torch.device):
        name = str(name)
    spec = name.strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")

    kind, _, index_text = spec.partition(":")
    index: int | None = None
    if index_text:
        if not index_text.isdigit():
            raise ValueError(f"bad device index in {name!r}; expected e.g. 'cuda:0'")
        index = int(index_text)

    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            reason = (
                "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            )
            raise DeviceUnavailableError(
                f"device {name!r} requested but torch.cuda.is_available() is False ({reason}); "
                "use --device cpu or --device auto"
            )
        _check_index("cuda", index, torch.cuda.device_count())
        return torch.device(spec)
    if kind == "npu":
        _import_torch_npu()
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise DeviceUnavailableError(f"device {name!r} requested: torch_npu is installed but no NPU is available")
        _check_index("npu", index, torch.npu.device_count())  # type: ignore[attr-defined]
        return torch.device(spec)
    raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)} (or e.g. 'cuda:1')")


def _bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "npu":
        probe = getattr(torch.npu, "is_bf16_supported", None)  # type: ignore[attr-defined]
        return bool(probe()) if probe is not None else True
    return True  # CPU (and anything else torch accepts) emulates bf16 where it lacks hardware support


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a dtype flag to a torch dtype the device can run; `auto` picks the fastest safe choice.

    auto: float32 on CPU (half precision is slower there and costs accuracy), bfloat16 on GPUs that support
    it (same range as float32, so no overflow in logits), else float16; bfloat16 on Ascend NPUs.
    """
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        spec = name.strip().lower().removeprefix("torch.")
        if spec == "auto":
            if device.type == "cuda":
                return torch.bfloat16 if _bf16_supported(device) else torch.float16
            if device.type == "npu":
                return torch.bfloat16 if _bf16_supported(device) else torch.float16
            return torch.float32
        if spec not in _DTYPE_ALIASES:
            raise ValueError(
                f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)} "
                "(aliases: fp32, float, bf16, fp16, half)"
            )
        dtype = _DTYPE_ALIASES[spec]

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"dtype {dtype} is not supported for model weights; use float32, bfloat16 or float16"
        )
    if dtype == torch.bfloat16 and not _bf16_supported(device):
        raise DeviceUnavailableError(f"bfloat16 is not supported on {device}; use --dtype float16 or --dtype auto")
    return dtype
