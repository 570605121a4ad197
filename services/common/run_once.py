"""An async operation that runs at most once, however often it is asked for, with every caller waiting for that
one run: a service's stop, started by a signal and asked for again on the service's way out. A second call that
returned at once let the service end its loop under the first (the verifier's engine shutdown cancelled midway)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class RunOnce:
    def __init__(self, name: str) -> None:
        self.name = name  # the task's name, for tracebacks and asyncio debugging
        self._task: asyncio.Task | None = None

    async def run(self, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start `start()` if nothing has started yet, then wait for the one run (a caller cancelled does not
        cancel it)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(start(), name=self.name)
        await asyncio.shield(self._task)

    async def wait(self) -> None:
        """Wait for the run, if one has started."""
        if self._task is not None:
            await asyncio.shield(self._task)
