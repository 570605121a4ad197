"""The benches' requests, read as the verifier reads them for the gateway that `specserve serve`, docker-compose and
the chart deploy: every request's outputs put into one GenerateMany call's RequestMux (request_mux.py), one reader
taking each step's outputs in one go, as the servicer's writer does before it sends them as one message.

Read instead with a task a request (`engine.generate`), each step's outputs woke one task a request, and an engine
step that asked its drafter over gRPC found those wakeups ready to run ahead of its answer (64 at 64 rows, against 1
read through the mux): an ask of 3 rows at 64 running took 5.9 ms so, 2.3-2.9 ms through the mux (ngram over gRPC,
engine_host_cost's mixed text on a simulated H200 step, 2-core EPYC). That is what a gateway without
`--verifier-shared-stream` makes the verifier pay (a Generate call a request), not what the deployed one does.
"""

from __future__ import annotations

import asyncio

from services.verifier.engine import Engine
from services.verifier.request_mux import RequestMux
from services.verifier.sampling_params import GenerationRequest


class MuxedClients:
    """Requests started on one RequestMux; `generate` returns a request's tokens once it has finished. Use as an
    async context manager around the requests (its reader runs inside)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._mux = RequestMux()
        self._tokens: dict[str, list[int]] = {}
        self._finished: dict[str, asyncio.Future[list[int]]] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> MuxedClients:
        self._reader = asyncio.create_task(self._read(), name="bench-mux-reader")
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._mux.close_input()
        await self._reader

    async def generate(self, request: GenerationRequest) -> list[int]:
        """The tokens `request` generated (its error, raised, if it failed)."""
        name = request.request_id
        self._tokens[name] = []
        finished = self._finished[name] = asyncio.get_running_loop().create_future()
        self._mux.start(name, request.speculation.method or "", lambda sink: self._engine.add_request(request, sink))
        return await finished

    async def _read(self) -> None:
        while not self._mux.done:
            for update in await self._mux.next_updates():
                name = update.request_id
                if isinstance(update.item, Exception):
                    self._tokens.pop(name, None)
                    self._finished.pop(name).set_exception(update.item)
                    continue
                self._tokens[name] += update.item.token_ids
                if update.item.finished:
                    self._finished.pop(name).set_result(self._tokens.pop(name))
