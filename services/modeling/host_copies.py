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


def pinned_join(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` (on the host) joined along their first dimension, in pinned memory where CUDA is available: where a
    join then `pinned` copied every byte twice on the host (an EAGLE head's opening of 52 chats moves 18-36 MB of
    target states; a join of them took 1.7 ms on an H200's host)."""
    if not torch.cuda.is_available():
        return torch.cat(tensors)
    first = tensors[0]
    joined = torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    return torch.cat(tensors, out=joined)


class DeviceToHost:
    """Device-to-host copies queued during a step and read after its one wait.

    Every `.cpu()` or `.tolist()` of a device tensor waits for the device. A step read its accepted tokens so, then
    its logprobs and top logprobs (one wait each), and a step that feeds EAGLE moved the target's hidden states the
    same way, once more per prefill chunk. Queued into pinned memory instead, the copies run on the stream behind
    the step's work and one `wait()` covers them all (issue 29's target: one host sync a step). Elsewhere a queued
    copy is `.cpu()` as before: none on CPU, a blocking one on another accelerator (not tried: no NPU here).
    """

    def __init__(self) -> None:
        self._done: torch.cuda.Event | None = None

    def queue(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor that holds `tensor` once `wait()` returns (or after any later wait on the stream)."""
        cuda = tensor.device.type == "cuda"
        host = tensor.detach().to("cpu", non_blocking=cuda)  # from CUDA torch makes this copy into pinned memory
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record()
        return host

    def wait(self) -> None:
        """Return once every queued copy has landed (at once when a later wait already covered them)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
