"""One OpenAI request becomes one Generate call per choice; this module runs those calls and turns their token
messages into text events.

Each choice has its own detokenizer and stop-string matcher. n > 1 (or several prompts) run concurrently and
their events are merged in arrival order, each tagged with its choice index. When a stop string matches, the
choice ends at once and its call is cancelled (the verifier frees the slot); when the consumer goes away (client
disconnect), every call still running is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from services.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.gateway.errors import ApiError
from services.gateway.metrics import NO_METHOD, GatewayMetrics
from services.gateway.verifier_client import VerifierClient, pb

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[Any]  # pb.TokenLogprob of the tokens in this event
    finish_reason: str | None
    completion_tokens: int  # tokens generated so far by this choice
    speculation: Any  # pb.SpeculationStats, cumulative
    prompt_logprobs: list[Any] = field(default_factory=list)  # pb.TokenLogprob per prompt token after the first
    cached_tokens: int = 0  # prompt tokens the verifier found in its prefix cache
    token_ids: list[int] = field(default_factory=list)  # the tokens of this event
    # vLLM's stop_reason, on the last event: the stop string or stop_token_ids token that ended the choice
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class TextRules:
    """How a choice's tokens become its text: stop strings (looked for only once more than `min_tokens` tokens
    are out, as vLLM does), whether the stop string or stop token that ended it stays in the text, and which
    ids count as stop_token_ids for stop_reason (an end-of-sequence token's is None)."""

    stops: Sequence[str] = ()
    include_stop: bool = False
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class ChoiceTimer:
    """Feeds the latency histograms from one choice's message arrivals (`method`: the speculation method the
    verifier reports for the request, every message carries it). The gap series of the method are looked up
    when the method is first seen, not at every message."""

    metrics: GatewayMetrics
    model_name: str
    start: float
    last: float | None = None
    _method: str | None = field(default=None, init=False, repr=False)
    _observe_gap: Callable[[float], None] | None = field(default=None, init=False, repr=False)

    def on_message(self, method: str) -> None:
        now = time.perf_counter()
        method = method or NO_METHOD
        if self.last is None:
            self.metrics.observe_first_token(self.model_name, method, now - self.start)
        else:
            if method != self._method:  # the first gap too: _method starts as None, a method never is
                self._method, self._observe_gap = method, self.metrics.token_gap_observer(self.model_name, method)
            self._observe_gap(now - self.last)
        self.last = now


async def run_choice(client: VerifierClient, request: Any, index: int, decode: Callable[[list[int]], str],
                     rules: TextRules, timer: ChoiceTimer) -> AsyncIterator[ChoiceEvent]:
    detok = IncrementalDetokenizer(decode, request.prompt_token_ids)
    matcher = StopStringMatcher(rules.stops, rules.include_stop)
    generated = 0
    async with aclosing(client.generate(request)) as stream:
        async for response in stream:
            timer.on_message(response.speculation.method)
            ids = list(response.token_ids)
            generated += len(ids)
            stop_token = response.stop_token_id if response.HasField("stop_token_id") else None
            text_ids = ids[:-1] if stop_token is not None and not rules.include_stop else ids
            text, stopped = matcher.push(detok.push(text_ids), check=generated > rules.min_tokens)
            finish = "stop" if stopped else None
            if not stopped and response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                tail, stopped = matcher.push(detok.flush(), check=generated > rules.min_tokens)
                text += tail if stopped else tail + matcher.flush()
                finish = "stop" if stopped else _FINISH.get(response.finish_reason, "stop")
            reason = matcher.matched if stopped else stop_token if stop_token in rules.stop_token_ids else None
            yield ChoiceEvent(index, text, list(response.logprobs), finish, generated, response.speculation,
                              list(response.prompt_logprobs), response.usage.cached_tokens, ids, reason)
            if finish is not None:
                return  # leaving the `async with` cancels the call when a stop string ended it early
    raise ApiError(503, "the verifier ended a generation without finishing it", code="incomplete_stream")


async def merge(streams: list[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    """Events of all streams as they arrive. The first error ends everything; so does closing this iterator."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for event in only:
                yield event
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[ChoiceEvent]) -> None:
        try:
            async with aclosing(stream) as s:
                async for event in s:
                    queue.put_nowait(event)
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
