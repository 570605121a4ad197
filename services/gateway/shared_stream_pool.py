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
initial metadata, services/common/verifier_metadata.py), and where two reached the same one, one of them is
replaced, at most once every `spread_interval_s`, so that a verifier that comes (back) gets its share within
seconds, not at the next renewal. With fewer verifiers than calls, that costs one new call per interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.shared_stream import SharedStream


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

    @property
    def streams(self) -> list[SharedStream]:
        return [member.stream for member in self._members]

    def pick(self, stub: Any) -> SharedStream:
        """The call a request starts on. Calls that ended, were made on a channel since replaced (not `stub`) or
        are older than max_age_s are retired first, and the pool is filled up to its size with new calls on
        `stub`."""
        now = self._clock()
        self._retired = [stream for stream in self._retired if not stream.ended]
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
        """`members` less the newest call whose verifier another call already has (it is retired), if any."""
        seen: set[str] = set()
        duplicate = None
        for member in sorted(members, key=lambda m: m.made_at):
            verifier = member.stream.verifier_id
            if verifier is not None and verifier in seen:
                duplicate = member
            elif verifier is not None:
                seen.add(verifier)
        if duplicate is None:
            return members
        self._spread_at = now + self.spread_interval_s
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
