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
