"""A request's stream of outputs, as the engine's callers consume it (async iteration, or polling for callers
that drive the engine's steps themselves)."""

from __future__ import annotations

from collections.abc import Callable

from services.verifier.outputs import RequestOutput
from services.verifier.request_state import RequestState


class RequestStream:
    """Async iterator over one request's outputs; ends after the output that carries a finish reason."""

    def __init__(self, state: RequestState, abort: Callable[[str], bool]) -> None:
        self._abort = abort
        self._state = state
        self._done = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._state.outputs.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def ready_outputs(self) -> list[RequestOutput]:
        """The outputs available now, without waiting (for callers that drive Engine.step themselves)."""
        ready = []
        while not self._done and not self._state.outputs.empty():
            item = self._state.outputs.get_nowait()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._done = item.finished
            ready.append(item)
        return ready

    def abort(self) -> None:
        if not self._done:
            self._abort(self.request_id)
