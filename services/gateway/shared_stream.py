"""One GenerateMany call (verifier.proto) that the gateway's requests share, where a Generate call each would cost
the verifier a message per request per engine step (services/bench/verifier_stream_cost.py: at 64 requests, a
third of its throughput on a 2-core host).

Requests start and abort by messages on the call; a reader task hands each update to its request's queue. When the
call ends or breaks, every request still on it gets the call's error (UNAVAILABLE when the verifier just ended it),
so VerifierClient treats it as it treats a Generate call that failed: retried once on a fresh channel if nothing
was received yet, else an error for that request.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from services.common import protos
from services.common.verifier_metadata import VERIFIER_ID_KEY

pb, _ = protos.load("verifier")


def status_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error shaped as a failed gRPC call's, so the gateway maps it as it maps those (errors.from_grpc)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}
END_TIMEOUT_S = 5.0  # how long a retired call's verifier has to end it once it is half-closed


def update_error(error: Any) -> grpc.aio.AioRpcError:
    """A request's RequestError as the error its own Generate call would have ended with."""
    return status_error(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message)


class SharedStream:
    def __init__(self, stub: Any) -> None:
        self.stub = stub  # what the call was made on (VerifierClient replaces a channel that failed)
        self._call = stub.GenerateMany()  # no deadline: it lives while requests use it; each request keeps its own
        self._queues: dict[str, asyncio.Queue] = {}
        self._write_lock = asyncio.Lock()  # grpc.aio takes one write at a time
        self._pending: set[asyncio.Task] = set()  # aborts being sent, and the closing once retired
        self.error: grpc.RpcError | None = None  # why the call ended; set once it has
        self._retired = False  # replaced: no request starts on it any more, it ends when its last one is done
        self.verifier_id: str | None = None  # the verifier serving the call, once its initial metadata is in
        self._reader = asyncio.create_task(self._read(), name="specserve-shared-stream")

    async def _read(self) -> None:
        try:
            metadata = await self._call.initial_metadata()
            self.verifier_id = dict(metadata or ()).get(VERIFIER_ID_KEY)
            async for message in self._call:
                for update in message.updates:
                    queue = self._queues.get(update.request_id)
                    if queue is not None:
                        queue.put_nowait(update)
            error: grpc.RpcError = status_error(grpc.StatusCode.UNAVAILABLE, "the verifier ended the shared stream")
        except grpc.RpcError as failure:
            error = failure
        self._fail(error)

    def _fail(self, error: grpc.RpcError) -> None:
        self.error = error
        for queue in self._queues.values():
            queue.put_nowait(error)

    @property
    def load(self) -> int:
        """Requests running on the call."""
        return len(self._queues)

    async def start(self, request: Any) -> asyncio.Queue:
        """Start `request` (its request_id set) on the call; its updates, then possibly the call's error, arrive on
        the queue returned. Raises the call's error if it has ended."""
        if self.error is not None:
            raise self.error
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        try:
            async with self._write_lock:
                await self._call.write(pb.StreamRequest(start=request))
        except (grpc.RpcError, asyncio.InvalidStateError) as failure:
            self._queues.pop(request.request_id, None)
            if self.error is None:
                self._fail(failure if isinstance(failure, grpc.RpcError)
                           else status_error(grpc.StatusCode.UNAVAILABLE, f"the shared stream broke: {failure}"))
            raise self.error from None
        return queue

    def finish(self, request_id: str, abort: bool) -> None:
        """The request is done with; `abort`: it had not finished, so the verifier stops it and frees its slot (sent
        in the background: this runs when a consumer leaves, perhaps while it is being cancelled)."""
        self._queues.pop(request_id, None)
        if abort and self.error is None:
            self._in_background(self._send_abort(request_id))
        if self._retired and not self._queues:
            self._in_background(self._end())

    def retire(self) -> None:
        """No request starts on this call any more (a new one replaces it): it ends once its last is done."""
        if self._retired:
            return
        self._retired = True
        if not self._queues:
            self._in_background(self._end())

    async def _end(self) -> None:
        """End a retired call with nothing left on it as a finished call ends: half-closed here, ended by the
        verifier. (Cancelled, it read on a verifier that was shutting down as a servicer's unhandled error.)"""
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError, TimeoutError):
            async with self._write_lock:
                await self._call.done_writing()
            async with asyncio.timeout(END_TIMEOUT_S):
                await asyncio.wait({self._reader})
        await self.close()  # ended (a no-op then), or cancelled if the verifier did not end it in time

    def _in_background(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_abort(self, request_id: str) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            async with self._write_lock:
                await self._call.write(pb.StreamRequest(abort=request_id))

    async def close(self) -> None:
        """End the call (the verifier aborts whatever still runs on it; a request still waiting on it gets
        CANCELLED)."""
        self._call.cancel()
        if self.error is None:
            self._fail(status_error(grpc.StatusCode.CANCELLED, "the shared stream was closed"))
        current = asyncio.current_task()
        others = [task for task in (self._reader, *self._pending) if task is not current]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
