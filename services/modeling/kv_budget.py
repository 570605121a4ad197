"""How much memory the paged KV pool takes: a budget in bytes, as vLLM's `--kv-cache-memory-bytes` (and, on CPU,
its `VLLM_CPU_KVCACHE_SPACE`), turned into a number of blocks.

Without a budget the pool takes DEFAULT_FRACTION of the memory available when it is made (MemAvailable on CPU,
free device memory on an accelerator), at most DEFAULT_CAP_BYTES and at most twice what max_num_seqs sequences of
max_model_len tokens fill, and never less than one max_model_len sequence needs. The pool is written through once
when it is made (paged_kv_cache.py), so it is resident from the start: a process started after it (a model drafter,
another stack on the host) sees the memory as taken and sizes its own pool from what is left, instead of several
pools each promised the same free memory.

With vLLM's `--gpu-memory-utilization u`, the instance may hold u of the device's memory: the pool, made once the
weights are loaded, takes what is free beyond the (1 - u) of the device's total that is left to others, all of it
(not capped), as vLLM's pool does. On a CPU the device is the host's RAM (MemTotal, MemAvailable). A budget in
bytes, given too, wins, as in vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from services.modeling.paged_kv_cache import DEFAULT_BLOCK_SIZE

DEFAULT_FRACTION = 0.4
DEFAULT_CAP_BYTES = 4 << 30

def available_memory(device: torch.device) -> int:
    """Bytes that could still be allocated on `device` now."""
    if device.type != "cpu":  # cuda, npu (torch_npu's torch.npu mirrors torch.cuda)
        free, _ = getattr(torch, device.type).mem_get_info(device)
        return free
    return _meminfo("MemAvailable:") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_memory(device: torch.device) -> int:
    """Bytes of memory `device` has in all."""
    if device.type != "cpu":
        _, total = getattr(torch, device.type).mem_get_info(device)
        return total
    return _meminfo("MemTotal:") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class KVCacheConfig:
    memory_bytes: int | None = None  # None: memory_utilization's, else DEFAULT_FRACTION of what is available
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    memory_utilization: float | None = None  # vLLM's gpu_memory_utilization: the share of the device's memory

    def __post_init__(self) -> None:
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.memory_utilization}")

    @property
    def _sized_by_default(self) -> bool:
        return self.memory_bytes is None and self.memory_utilization is None

    def budget_bytes(self, device: torch.device) -> int:
        if self.memory_bytes is not None:
            return self.memory_bytes
        if self.memory_utilization is not None:
            left_to_others = (1 - self.memory_utilization) * total_memory(device)
            return max(0, int(available_memory(device) - left_to_others))
        return min(DEFAULT_CAP_BYTES, int(DEFAULT_FRACTION * available_memory(device)))

    def num_blocks(self, bytes_per_token: int, max_model_len: int, max_num_seqs: int, device: torch.device) -> int:
        """Blocks the budget holds, plus the null block. ValueError when an explicit budget cannot hold one
        sequence of max_model_len tokens. The default grows to hold one, and takes no more than twice what
        max_num_seqs sequences of max_model_len tokens fill (the rest could only ever hold cached prefixes)."""
        per_block = bytes_per_token * self.block_size
        needed = -(-max_model_len // self.block_size)
        blocks = self.budget_bytes(device) // per_block
        if self._sized_by_default:
            blocks = min(blocks, 2 * max_num_seqs * needed)
        if blocks < needed:
            if self.memory_bytes is not None:
                raise ValueError(
                    f"--kv-cache-memory-bytes {self.memory_bytes} holds {blocks * self.block_size} tokens, fewer "
                    f"than one sequence of max_model_len={max_model_len} needs "
                    f"({needed * per_block} bytes); raise it or lower --max-model-len"
                )
            if self.memory_utilization is not None:
                raise ValueError(
                    f"--gpu-memory-utilization {self.memory_utilization} leaves {blocks * per_block} bytes of "
                    f"{device.type} memory for the KV cache once the weights are loaded: {blocks * self.block_size} "
                    f"tokens, fewer than one sequence of max_model_len={max_model_len} needs "
                    f"({needed * per_block} bytes); raise it or lower --max-model-len"
                )
            blocks = needed
        return blocks + 1
