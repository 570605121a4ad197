"""Engine-wide speculation counters and the periodic log line operators read (vLLM's spec-decode family)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.verifier.outputs import SpecDecodeCounts

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats(SpecDecodeCounts):
    """Counters of one proposer (or, merged, of the engine): the per-request ones (and their rates) plus
    per-position and fallback counts."""

    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted
    drafts_per_position: list[int] = field(default_factory=list)  # [i]: drafts that proposed a token i
    num_fallbacks: int = 0  # proposer calls that missed the deadline or failed (their rows ran with K = 0)
    num_late_proposals: int = 0  # of those, the ones that missed the deadline: the drafter is too slow

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        grow = num_draft - len(self.drafts_per_position)
        if grow > 0:
            self.drafts_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_draft):
            self.drafts_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @classmethod
    def merged(cls, parts: Iterable[SpecDecodeStats]) -> SpecDecodeStats:
        """A new SpecDecodeStats holding the sums of `parts` (one part: a copy)."""
        total = cls()
        for part in parts:
            total.num_drafts += part.num_drafts
            total.num_draft_tokens += part.num_draft_tokens
            total.num_accepted_tokens += part.num_accepted_tokens
            total.num_fallbacks += part.num_fallbacks
            total.num_late_proposals += part.num_late_proposals
            for mine, theirs in (
                (total.drafts_per_position, part.drafts_per_position),
                (total.accepted_per_position, part.accepted_per_position),
            ):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, value in enumerate(theirs):
                    mine[i] += value
        return total


@dataclass
class PeriodicStatsLogger:
    """Logs the change in counters since the last line, at most once per interval."""

    interval_s: float
    _last_time: float = field(default_factory=time.monotonic)
    _last: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def due(self, now: float | None = None) -> bool:
        """Whether a line is due (callers whose stats are costly to assemble ask first)."""
        now = time.monotonic() if now is None else now
        return self.interval_s > 0 and now - self._last_time >= self.interval_s

    def maybe_log(self, stats: SpecDecodeStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self.due(now):
            return
        elapsed = now - self._last_time
        drafts = stats.num_drafts - self._last.num_drafts
        drafted = stats.num_draft_tokens - self._last.num_draft_tokens
        accepted = stats.num_accepted_tokens - self._last.num_accepted_tokens
        if drafts:
            per_position = [
                (a - a0) / max(1, d - d0)
                for a, a0, d, d0 in zip(
                    stats.accepted_per_position,
                    self._last.accepted_per_position + [0] * len(stats.accepted_per_position),
                    stats.drafts_per_position,
                    self._last.drafts_per_position + [0] * len(stats.drafts_per_position),
                    strict=False,
                )
            ]
            logger.info(
                "spec decode: mean acceptance length %.2f, acceptance rate %.1f%%, per-position acceptance %s, "
                "drafted %.1f tok/s, accepted %.1f tok/s, fallbacks %d (late %d)",
                1 + accepted / drafts,
                100.0 * accepted / max(1, drafted),
                "[" + ", ".join(f"{x:.2f}" for x in per_position) + "]",
                drafted / elapsed,
                accepted / elapsed,
                stats.num_fallbacks - self._last.num_fallbacks,
                stats.num_late_proposals - self._last.num_late_proposals,
            )
        self._last_time = now
        self._last = SpecDecodeStats.merged([stats])
