"""The GenerateMany calls the gateway's requests share (shared_stream.py), spread over the verifiers.

A call goes to one verifier: the channel balances calls, not the requests inside them (verifier_target.py), so
with several verifiers one shared call would send every request to whichever verifier it reached. The pool keeps
`size` calls (one per verifier is the intent), made one after another so that the channel's round robin puts each
on the next SERVING verifier, and starts each request on the call with the fewest requests running (ties taken in
turn). A call takes new requests for `max_age_s`, then is replaced (it ends once its last request is done): the
calls follow verifiers that join, restart or leave without the pool knowing them, and load the round robin placed
unevenly is placed again. A call whose verifier refused a request because it is draining is replaced at once
(`replace`).

Round robin places calls among the verifiers that serve when the call is made: calls made while one of them was
still loading, or while it restarted, all went to the others. Each call learns which verifier serves it (its
initial metadata, services/common/verifier_metadata.py), and where two reached the same one, the one with fewer
requests running is replaced, `spread_interval_s` after the last such replacement, so that a verifier that comes
(back) gets its share within seconds, not at the next renewal. Each replacement that finds two calls on one verifier
again doubles that wait, up to SPREAD_BACKOFF times it (and back to it once the calls are apart): with fewer
verifiers than calls for a long time, a replaced call comes every few seconds, not every second, each keeping its
running requests (and a message a step of its own) until they end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.shared_stream import SharedStream

SPREAD_BACKOFF = 8  # the longest wait between replacements of a call sharing a verifier, in spread_interval_s


@dataclass
class _Member:
    stream: SharedStream
    made_at: float


class SharedStreamPool:
    def __init__(self, size: int, max_age_s: float, spread_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if size < 1 or max_age_s <= 0:
            raise ValueError(f"a shared-stream pool needs size >= 1 and max_age_s > 0, got {size}, {max_age_s}")
        self.size = size
        self.max_age_s = max_age_s
        self.spread_interval_s = spread_interval_s
        self._clock = clock
        self._members: list[_Member] = []
        self._retired: list[SharedStream] = []  # replaced calls whose last requests still run (closed with the pool)
        self._turn = 0  # where the search for the least-loaded call starts: ties go round
        self._spread_at = 0.0  # when a call that shares its verifier with another may be replaced next
        self._spread_wait = spread_interval_s  # the wait after the next such replacement

    @property
    def streams(self) -> list[SharedStream]:
        return [member.stream for member in self._members]

    def pick(self, stub: Any) -> SharedStream:
        """The call a request starts on. Calls that ended, were made on a channel since replaced (not `stub`) or
        are older than max_age_s are retired first, and the pool is filled up to its size with new calls on
        `stub`."""
        now = self._clock()
        self._retired = [stream for stream in self._retired if stream.error is None]  # the ended ones go
        kept = []
        for member in self._members:
            if member.stream.error is None and member.stream.stub is stub and now - member.made_at < self.max_age_s:
                kept.append(member)
            else:
                self._retire(member.stream)
        if len(kept) > 1 and now >= self._spread_at:
            kept = self._spread(kept, now)
        while len(kept) < self.size:
            kept.append(_Member(SharedStream(stub), now))
        self._members = kept
        start = self._turn % len(kept)
        self._turn += 1
        order = kept[start:] + kept[:start]
        return min(order, key=lambda member: member.stream.load).stream

    def _spread(self, members: list[_Member], now: float) -> list[_Member]:
        """`members` less one of two calls on the same verifier (it is retired), if there are such."""
        by_verifier: dict[str, list[_Member]] = {}
        for member in members:
            if member.stream.verifier_id is not None:
                by_verifier.setdefault(member.stream.verifier_id, []).append(member)
        shared = [group for group in by_verifier.values() if len(group) > 1]
        if not shared:
            if len(by_verifier) == len(members):  # every call known, all apart: a later pile-up is spread quickly
                self._spread_wait = self.spread_interval_s
            return members
        duplicate = min(shared[0], key=lambda member: (member.stream.load, -member.made_at))
        self._spread_at = now + self._spread_wait
        self._spread_wait = min(2 * self._spread_wait, SPREAD_BACKOFF * self.spread_interval_s)
        self._retire(duplicate.stream)
        return [member for member in members if member is not duplicate]

    def replace(self, stream: SharedStream) -> None:
        """Take `stream` out of the pool (its verifier drains): no request starts on it any more; the next pick makes
        a new call in its place."""
        self._members = [member for member in self._members if member.stream is not stream]
        self._retire(stream)

    def _retire(self, stream: SharedStream) -> None:
        stream.retire()
        self._retired.append(stream)

    def broken(self) -> list[SharedStream]:
        """The calls in the pool that ended (the next pick replaces them)."""
        return [member.stream for member in self._members if member.stream.error is not None]

    async def close(self) -> None:
        """Close every call, the replaced ones still ending too, so that none outlives the client (and the event
        loop it was made on, which may close next)."""
        streams = [member.stream for member in self._members] + self._retired
        self._members, self._retired = [], []
        for stream in streams:
            await stream.close()
