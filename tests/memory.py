"""Resident memory as the kernel counts it, for tests that check what a change keeps in RAM."""

from __future__ import annotations


def mapping_rss(address: int) -> int:
    """Resident bytes of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


def resident_bytes(address: int, nbytes: int) -> int:
    """Resident bytes of the whole pages inside [address, address + nbytes) of this process, page by page
    (mincore(2)): exact for one allocation whatever mappings it shares or spans, where a mapping's Rss in smaps
    counts whatever else that mapping holds and misses what lies in the next one."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    first, last = -(-address // page) * page, (address + nbytes) // page * page
    if last <= first:
        return 0
    pages = (last - first) // page
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(last - first), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in bytes(vector)) * page
