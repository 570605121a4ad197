"""Give a freed weight's memory back to the system, also when it lives in a memory-mapped checkpoint.

transformers maps a safetensors file into memory and makes each weight a view of that one mapping; the mapping
stays while any weight of the file is alive, so dropping one weight frees nothing (SmolLM2: its 405 MiB of
packed-only weights stayed resident). For a range inside a file mapping, madvise(MADV_DONTNEED) drops the
resident pages (an unwritten private page is just the file again, and nothing reads the range once the weight
is gone). Memory from the allocator is left alone: there the allocator owns the pages, and dropping the
tensor is what frees them.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

_MADV_DONTNEED = 4


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed mappings (Linux /proc/self/maps)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    start, stop = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, stop))
    except OSError:
        pass
    return ranges


def release_mapped(tensors: list[torch.Tensor]) -> int:
    """Drop the resident pages of each CPU tensor that lies in a file mapping (whole pages inside it only, so
    a neighbouring weight sharing a page keeps it); returns the bytes released. Call only for weights nothing
    will read again."""
    if not tensors or os.name != "posix":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    mappings = _file_mappings()
    released = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        if not any(low <= start and stop <= high for low, high in mappings):
            continue
        first, last = -(-start // page) * page, stop // page * page
        if last > first and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0:
            released += last - first
    return released
