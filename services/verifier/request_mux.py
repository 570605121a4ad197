"""The requests of one GenerateMany stream (verifier.proto) and their outputs, gathered for the stream's next message.

Generate sends one message per request per engine step; at 64 requests that is 64 grpc.aio sends a step on the
loop that also runs the engine, whose forwards then start late (services/bench/verifier_stream_cost.py). Here the
engine puts each request's outputs into a sink of the stream's (OutputSink, as it would into the request's own
queue); a step puts all of its outputs in one go on the loop, so when the stream's writer next runs it finds them
all and sends them as one message.

Pure bookkeeping, no gRPC: the servicer reads the stream's requests into `start`/`abort` and writes what
`next_updates` returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.verifier.outputs import RequestOutput
from services.verifier.request_stream import RequestStream


@dataclass(frozen=True)
class Update:
    """One request's next output, or the error that ends it (a refusal, or a failure in the engine)."""

    request_id: str
    method: str  # what the request drafts with ("" without speculation), as Generate reports it
    item: RequestOutput | Exception
    refusal: bool = False  # the request never started (so a running one of the same id is not the one that ended)

    @property
    def last(self) -> bool:
        return isinstance(self.item, Exception) or self.item.finished


class _Sink:
    def __init__(self, mux: RequestMux, request_id: str, method: str) -> None:
        self._mux, self._request_id, self._method = mux, request_id, method

    def put_nowait(self, item: RequestOutput | Exception) -> None:
        self._mux.put(Update(self._request_id, self._method, item))


class RequestMux:
    def __init__(self) -> None:
        self._updates: list[Update] = []
        self._ready = asyncio.Event()
        self._running: dict[str, RequestStream] = {}  # request id -> its stream (to abort it)
        self._input_closed = False

    def start(self, request_id: str, method: str, add: Callable[[_Sink], RequestStream]) -> None:
        """Start a request: `add(sink)` queues it in the engine with `sink` for its outputs (the engine's
        add_request, which refuses an id in use); what it raises refuses this request only."""
        if not request_id:
            self.refuse(request_id, ValueError("GenerateMany needs a request_id on every request"))
            return
        try:
            stream = add(_Sink(self, request_id, method))
        except Exception as error:  # noqa: BLE001 - this request is refused, the stream goes on
            self.refuse(request_id, error)
            return
        self._running[request_id] = stream

    def refuse(self, request_id: str, error: Exception) -> None:
        """A request that did not start (unreadable, invalid, over capacity): its error update."""
        self.put(Update(request_id, "", error, refusal=True))

    def abort(self, request_id: str) -> None:
        """Abort a running request of this stream (unknown or finished ones: nothing to do)."""
        stream = self._running.get(request_id)
        if stream is not None:
            stream.abort()

    def put(self, update: Update) -> None:
        self._updates.append(update)
        self._ready.set()

    def close_input(self) -> None:
        """No more requests will start: the stream ends once the running ones have."""
        self._input_closed = True
        self._ready.set()

    @property
    def done(self) -> bool:
        return self._input_closed and not self._running and not self._updates

    async def next_updates(self) -> list[Update]:
        """Everything gathered since the last call, once there is something (or the stream is done: then [])."""
        while not self._updates and not self.done:
            self._ready.clear()
            await self._ready.wait()
        updates, self._updates = self._updates, []
        for update in updates:
            if update.last and not update.refusal:
                self._running.pop(update.request_id, None)
        return updates

    def abort_all(self) -> None:
        """The stream is gone: every request still running on it stops and frees its slot."""
        for stream in list(self._running.values()):
            stream.abort()
        self._running.clear()
