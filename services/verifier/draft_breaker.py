"""A circuit breaker per proposer: a drafter that keeps missing the draft deadline stops costing the steps.

A drafter that is dead drops its link and costs nothing (its calls fail at once). One that is alive but silent
(SIGSTOP, a GC pause, a full node, a partition) or far too slow under load costs every step the whole deadline:
measured on `make run`'s stack at 8 concurrent requests, a 20 s SIGSTOP took the inter-token gap from 0.03 s to
0.585 s, 20x slower than no speculation at all. So after OPEN_AFTER consecutive calls that were late or failed,
the breaker opens: the proposer's rows run at K = 0 without being asked, and a probe (the same draft call, in the
background, its answer thrown away) goes out at most every `backoff` seconds, starting at FIRST_BACKOFF_S and
doubling to MAX_BACKOFF_S while probes keep failing. A probe that answers within its deadline closes the breaker
and the next step asks the proposer as before. Steps never wait for a probe.

The decisions are pure (a clock is passed in); draft_collection.py runs the calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("services.verifier.engine")

OPEN_AFTER = 2  # consecutive late or failed calls: one GC pause or one lost packet does not open it
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 2.0  # a drafter that resumes is asked again within this plus one probe's deadline


@dataclass
class DraftBreaker:
    method: str
    consecutive_misses: int = 0
    open_since: float | None = None  # clock time the breaker opened; None: closed
    next_probe_at: float = 0.0
    backoff_s: float = FIRST_BACKOFF_S
    probing: bool = False  # a probe call is in flight
    num_openings: int = 0
    skipped_steps: int = 0  # steps of the current opening whose rows ran at K = 0 unasked

    @property
    def is_open(self) -> bool:
        return self.open_since is not None

    def missed(self, now: float, reason: str) -> None:
        """A call was late or failed."""
        self.consecutive_misses += 1
        if not self.is_open and self.consecutive_misses >= OPEN_AFTER:
            self.open_since = now
            self.backoff_s = FIRST_BACKOFF_S
            self.next_probe_at = now + self.backoff_s
            self.num_openings += 1
            self.skipped_steps = 0
            logger.warning(
                "drafter %r degraded: %d calls in a row late or failed (last: %s); its requests run at K = 0 "
                "without waiting for it, and it is probed in the background", self.method, self.consecutive_misses,
                reason,
            )

    def answered(self, now: float) -> None:
        """A call answered within its deadline (a step's call or a probe): close."""
        self.consecutive_misses = 0
        if self.is_open:
            logger.info("drafter %r answers in time again after %.1f s degraded (%d steps ran at K = 0 unasked); "
                        "its requests draft again", self.method, now - self.open_since, self.skipped_steps)
        self.open_since = None
        self.probing = False

    def skip(self) -> None:
        """A step ran this proposer's rows at K = 0 without asking it (the breaker is open)."""
        self.skipped_steps += 1

    def probe_due(self, now: float) -> bool:
        """Whether to send a probe now (open, none in flight, backoff passed); if so the probe counts as sent."""
        if not self.is_open or self.probing or now < self.next_probe_at:
            return False
        self.probing = True
        return True

    def probe_failed(self, now: float) -> None:
        self.probing = False
        self.backoff_s = min(MAX_BACKOFF_S, 2 * self.backoff_s)
        self.next_probe_at = now + self.backoff_s
