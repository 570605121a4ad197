"""One host thread for torch's own CPU operations where the model runs on an accelerator.

There the host only builds small index tensors and launches; torch's intra-op pool (one per calling thread, as
many threads as cores) buys nothing on tensors of a few thousand elements, and two calling threads (the asyncio
loop and the compute thread) each waking a pool of 16 spinning threads cost an H100 machine's host 0.9 ms for a 5 x 5
`tril` (cProfile, `python -m services.bench.step_host_profile`). vLLM's GPU workers run with OMP_NUM_THREADS=1
for the same reason. A user's own OMP_NUM_THREADS is kept.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def limit_host_threads(device: torch.device) -> None:
    """torch.set_num_threads(1) when `device` is an accelerator and OMP_NUM_THREADS is not set."""
    if device.type == "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    if torch.get_num_threads() != 1:
        logger.info("model on %s: torch's host-side operations run on 1 thread (were %d; OMP_NUM_THREADS sets it)",
                    device, torch.get_num_threads())
        torch.set_num_threads(1)
