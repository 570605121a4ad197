"""Give the heap that start-up freed back to the operating system.

Start-up allocates and frees a lot: loading the checkpoint, the kernel choice timing each linear's candidates,
the thread placement and the step-cost profile running forwards of several shapes. glibc keeps what was freed in
its heap for later allocations instead of returning it, so a process that will never allocate that much again
holds it for its whole life: 230 MiB in a SmolLM2 verifier on a 2-core Intel Xeon (RSS 1,557 MiB with a 384 MiB
pool; 1,327 MiB after a trim). malloc_trim(0) returns every free page of the heap. Called once, when start-up is
done; a no-op where the C library has no malloc_trim (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from services.common.process_memory import resident_bytes

logger = logging.getLogger(__name__)


def trim_heap(when: str) -> int:
    """Return the heap's free pages to the OS; logs and returns the resident bytes it gave back (0 where it
    cannot tell or cannot trim)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return 0
    before = resident_bytes()
    trim(0)
    after = resident_bytes()
    freed = max(0, before - after) if before is not None and after is not None else 0
    logger.info("%s: %.0f MiB of freed heap given back to the OS (resident now %.0f MiB)", when, freed / 2**20,
                (after or 0) / 2**20)
    return freed
