"""Log a proposer's outage once when it starts and once when it ends, not once per step.

While a drafter is away, every engine step that would use it runs its rows with K = 0 (a fallback, counted by the
engine). At ~40 steps a second, a log line per failed step buries everything else in the log; operators need to
know when an outage started, why, when it ended and what it cost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("services.verifier.engine")

# Failures that are a drafter being away or slow, not a bug: no traceback for them.
EXPECTED_FAILURES = (ConnectionError, TimeoutError)


@dataclass
class _Outage:
    started_at: float
    reason: str
    num_fallback_steps: int = 0


class ProposerOutageLog:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._outages: dict[str, _Outage] = {}

    def failed(self, method: str, error: BaseException | str) -> None:
        """A step of `method` fell back to K = 0 because of `error` (an exception or a description)."""
        outage = self._outages.get(method)
        if outage is None:
            reason = error if isinstance(error, str) else (str(error) or type(error).__name__)
            outage = self._outages[method] = _Outage(self._clock(), reason)
            unexpected = isinstance(error, BaseException) and not isinstance(error, EXPECTED_FAILURES)
            logger.warning(
                "proposer %r unavailable: %s; its requests run with K = 0 until it is back",
                method,
                reason,
                exc_info=error if unexpected else None,
            )
        outage.num_fallback_steps += 1

    def succeeded(self, method: str) -> None:
        outage = self._outages.pop(method, None)
        if outage is not None:
            logger.info(
                "proposer %r is back after %.1f s; %d steps ran with K = 0 meanwhile",
                method,
                self._clock() - outage.started_at,
                outage.num_fallback_steps,
            )

    def is_down(self, method: str) -> bool:
        return method in self._outages
