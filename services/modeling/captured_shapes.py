"""Graphs captured once per shape, for a computation that replays them (the EAGLE drafter's chains and trees,
eagle_head_graphs.py, and its catch-up, eagle_catch_up.py): a shape is captured the first time it is needed (or
ahead of serving), and a shape the platform refuses to capture is remembered and runs eagerly from then on, so a
refused capture costs speed, never a result."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Captured = TypeVar("Captured")


class CapturedShapes(Generic[Captured]):
    def __init__(self, what: str) -> None:
        self.what = what  # what is captured, for the log ("EAGLE drafting")
        self.graphs: dict[Hashable, Captured] = {}
        self.refused: set[Hashable] = set()
        self.seconds = 0.0  # spent capturing

    def known(self, shape: Hashable) -> bool:
        """Captured or refused already."""
        return shape in self.graphs or shape in self.refused

    def get(self, shape: Hashable, capture: Callable[[], Captured], ahead: bool = False) -> Captured | None:
        """The graph of `shape`, captured now by `capture()` where it is new; None where the platform refused it
        (logged once). `ahead`: captured before serving, logged in one line by the caller rather than each."""
        if shape in self.refused:
            return None
        found = self.graphs.get(shape)
        if found is not None:
            return found
        started = time.perf_counter()
        try:
            found = capture()
        except Exception:  # noqa: BLE001 - a capture the platform refuses costs speed, never a result
            logger.exception("capturing %s of shape %s failed; that shape runs eagerly", self.what, shape)
            self.refused.add(shape)
            return None
        seconds = time.perf_counter() - started
        self.graphs[shape] = found
        self.seconds += seconds
        logger.log(logging.DEBUG if ahead else logging.INFO, "captured %s of shape %s in %.2f s (%d graphs)",
                   self.what, shape, seconds, len(self.graphs))
        return found

    def __len__(self) -> int:
        return len(self.graphs)
