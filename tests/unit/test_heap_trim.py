"""trim_heap gives back what a fragmented heap holds after frees (what start-up leaves behind)."""

from __future__ import annotations

import ctypes.util
import sys

import pytest

from services.common.heap_trim import trim_heap
from services.common.process_memory import resident_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="malloc_trim and /proc are glibc and Linux's")
def test_freed_heap_between_live_blocks_goes_back_to_the_os():
    blocks = [bytearray(8192) for _ in range(40_000)]  # 320 MiB of heap chunks (below the mmap threshold)
    for block in blocks:
        block[::4096] = b"x" * len(block[::4096])  # touch every page, so it is resident
    kept = blocks[::32]  # a live block every 256 KiB: glibc cannot shrink the heap from its top
    del blocks
    before = resident_bytes()
    freed = trim_heap("test")
    assert before is not None and freed > 200 * 2**20, (before, freed)
    assert len(kept) == 1250
