"""Per-drafter health as the verifier observes it, for Info and metrics.

RemoteProposer repairs its link by itself and reports trouble only as exceptions from `propose`; this wrapper
watches those outcomes (and the engine's deadline cancelling a call) and keeps the last state, a reason and a
fallback count per drafter. It is a Proposer itself, so the engine sees no difference.

Outcomes alone go stale when no request uses a drafter: one that came back (or died) while idle would keep its
old state. So a watcher asks the drafter's Info whenever no step has succeeded for a health interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence

import grpc

from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.verifier.remote_proposer import (
    DrafterLateError,
    IncompatibleDrafterError,
    RemoteProposer,
)
from services.verifier.wire import DrafterReport, verifier_pb2

SERVING = verifier_pb2.DRAFTER_STATE_SERVING
DISCONNECTED = verifier_pb2.DRAFTER_STATE_DISCONNECTED
REFUSED = verifier_pb2.DRAFTER_STATE_REFUSED
DEGRADED = verifier_pb2.DRAFTER_STATE_DEGRADED


class TrackedProposer:
    def __init__(
        self,
        name: str,
        proposer: RemoteProposer,
        observe_round_trip: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.name = name
        self.proposer = proposer
        self._observe = observe_round_trip
        self._state = DISCONNECTED
        self._detail = "not reached yet"
        self._reached = False
        self._last_success = float("-inf")  # time.monotonic() of the last successful probe or step
        self._watcher: asyncio.Task | None = None

    @property
    def method(self) -> str:
        return self.proposer.method

    @property
    def capabilities(self) -> ProposerCapabilities | None:
        """What the drafter declared in Info; None until it was reached."""
        return self.proposer.capabilities

    async def probe(self) -> None:
        """Ask the drafter's Info once (under its own deadline) and record the outcome; never raises."""
        try:
            await self.proposer.info()
        except Exception as error:  # noqa: BLE001 - any failure is a state to report, not a crash
            self._record_failure(error)
        else:
            self._record_success()

    def start_watching(self, interval_s: float, answered: Callable[[], None] = lambda: None) -> None:
        """Probe every `interval_s` in which no step succeeded (0: never); stopped by close(). `answered` runs
        after each probe answered in time: the engine re-admits a drafter its breaker had stopped asking, which
        matters when no request is running to send the breaker's own probes."""
        if interval_s > 0 and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(interval_s, answered),
                                                name=f"specserve-watch-{self.name}")

    async def _watch(self, interval_s: float, answered: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if time.monotonic() - self._last_success >= interval_s:
                await self.probe()
                if self._state == SERVING:
                    answered()

    async def propose(self, inputs: Sequence[DraftInput]) -> Sequence[Draft]:
        started = time.perf_counter()
        try:
            drafts = await self.proposer.propose(inputs)
        except asyncio.CancelledError:  # the engine's per-step deadline
            self._detail = "missed the engine's draft deadline"
            raise
        except Exception as error:
            self._record_failure(error)
            raise
        self._observe(time.perf_counter() - started)
        self._record_success()
        return drafts

    def release(self, seq_id: Hashable) -> None:
        self.proposer.release(seq_id)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        await self.proposer.close()

    def report(self, num_fallbacks: int = 0, degraded: bool = False) -> DrafterReport:
        """State as observed here; `num_fallbacks` comes from the engine, which counts every lost step, and
        `degraded` from its circuit breaker (draft_breaker.py): a link that is up but whose answers come late."""
        state, detail = self._state, self._detail
        if degraded and state == SERVING:
            state, detail = DEGRADED, "late or failing several calls in a row: not waited for while probed"
        return DrafterReport(
            name=self.name,
            method=self.proposer.method if self._reached else "",
            address=self.proposer.config.target,
            state=state,
            detail="" if state == SERVING else detail,
            num_fallbacks=num_fallbacks,
        )

    def _record_success(self) -> None:
        self._last_success = time.monotonic()
        self._reached = True
        self._state = SERVING
        self._detail = ""

    def _record_failure(self, error: BaseException) -> None:
        if isinstance(error, grpc.aio.AioRpcError):
            self._detail = f"{error.code().name}: {error.details()}"
        else:
            self._detail = str(error) or type(error).__name__
        if isinstance(error, IncompatibleDrafterError):
            self._state = REFUSED
        elif isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._state = DEGRADED  # reachable, but silent past the deadline (hung, paused, overloaded)
        elif not isinstance(error, DrafterLateError):  # late: the link is up, only this step is lost
            self._state = DISCONNECTED
