"""Host-to-device copies that do not make the host wait.

A copy from ordinary (pageable) host memory synchronizes the CUDA stream: the host stops until the device has
caught up, so a step that built its inputs with `torch.tensor(..., device="cuda")` a dozen times waited a dozen
times (19 stream syncs a step were counted on an H100, issue 29). From pinned memory the copy is queued like a
kernel and the host goes on. torch's pinned-memory allocator keeps a block alive until the copies that read it have
run, so the host tensor may be dropped at once.
"""

from __future__ import annotations

import torch


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (on the host) in pinned memory where CUDA is available; as it is otherwise."""
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device`: on CUDA from pinned memory without waiting; elsewhere a plain copy
    (none on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return pinned(tensor).to(device, non_blocking=True)
    return tensor.to(device)
