"""How much memory the paged KV pool takes: a budget in bytes, as vLLM's `--kv-cache-memory-bytes` (and, on CPU,
its `VLLM_CPU_KVCACHE_SPACE`), turned into a number of blocks.

Without a budget the pool takes DEFAULT_FRACTION of the memory available when it is made (MemAvailable on CPU,
free device memory on an accelerator), at most DEFAULT_CAP_BYTES and at most twice what max_num_seqs sequences of
max_model_len tokens fill, and never less than one max_model_len sequence needs. The pool is written through once
when it is made (paged_kv_cache.py), so it is resident from the start: a process started after it (a model drafter,
another stack on the host) sees the memory as taken and sizes its own pool from what is left, instead of several
pools each promised the same free memory.
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
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class KVCacheConfig:
    memory_bytes: int | None = None  # None: DEFAULT_FRACTION of what is available, at most DEFAULT_CAP_BYTES
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True

    def budget_bytes(self, device: torch.device) -> int:
        if self.memory_bytes is not None:
            return self.memory_bytes
        return min(DEFAULT_CAP_BYTES, int(DEFAULT_FRACTION * available_memory(device)))

    def num_blocks(self, bytes_per_token: int, max_model_len: int, max_num_seqs: int, device: torch.device) -> int:
        """Blocks the budget holds, plus the null block. ValueError when an explicit budget cannot hold one
        sequence of max_model_len tokens. The default grows to hold one, and takes no more than twice what
        max_num_seqs sequences of max_model_len tokens fill (the rest could only ever hold cached prefixes)."""
        per_block = bytes_per_token * self.block_size
        needed = -(-max_model_len // self.block_size)
        blocks = self.budget_bytes(device) // per_block
        if self.memory_bytes is None:
            blocks = min(blocks, 2 * max_num_seqs * needed)
        if blocks < needed:
            if self.memory_bytes is not None:
                raise ValueError(
                    f"--kv-cache-memory-bytes {self.memory_bytes} holds {blocks * self.block_size} tokens, fewer "
                    f"than one sequence of max_model_len={max_model_len} needs "
                    f"({needed * per_block} bytes); raise it or lower --max-model-len"
                )
            blocks = needed
        return blocks + 1
