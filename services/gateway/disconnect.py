"""Stop generating for a client that has gone away, before the response has started.

A streaming response notices a disconnect when it writes (Starlette also listens for it), but until the first
token exists there is nothing to write — a long prompt's prefill, a queue wait — and a non-streaming request
writes nothing until the whole generation is done. Meanwhile the verifier would keep the request's KV slot.
So the work before the response runs beside a watcher of the ASGI receive channel; if the client disconnects
first, the work is cancelled, which closes its Generate calls and makes the verifier free the slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before a response could be sent."""


async def _until_disconnected(request: Request) -> None:
    # The body has been read already, so the next message the server delivers is the disconnect (or, after the
    # response, nothing we wait for: the watcher is cancelled by then).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first: then cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # let the cancelled work close its calls
    raise ClientDisconnected
