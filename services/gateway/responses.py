"""Shaping ChoiceEvents into OpenAI objects: whole responses, SSE chunks, logprobs, usage and the
`speculative_decoding` extension. Kept apart from the HTTP routes so both endpoints share one accounting."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from services.common.sampling_rules import LOGPROB_FLOOR
from services.gateway import schemas as s
from services.gateway.generation import ChoiceEvent


def finite_logprob(value: float) -> float:
    """A token filtered out by top-p/top-k/min-p has logprob -inf under the processed distribution; the
    verifier should send the floor already, but whatever it sends, the client gets a finite number."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def sse(payload: BaseModel | dict | str) -> bytes:
    """One server-sent event. The Responses API's events are also named on an `event:` line by their type, as
    OpenAI's server sends them (the SDKs read the type from the data; EventSource clients listen by name)."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=False)
        if getattr(payload, "NAMED_SSE_EVENT", False):
            return f"event: {payload.type}\ndata: {text}\n\n".encode()
    elif isinstance(payload, dict):
        text = json.dumps(payload)
    else:
        text = payload
    return f"data: {text}\n\n".encode()


@dataclass
class SpecTotals:
    method: str = ""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, stats: Any) -> None:
        self.method = self.method or stats.method
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens

    def model(self) -> s.SpeculativeDecoding:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean_len = 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
        return s.SpeculativeDecoding(method=self.method or "none", num_drafts=self.num_drafts,
                                     num_draft_tokens=self.num_draft_tokens,
                                     num_accepted_tokens=self.num_accepted_tokens, acceptance_rate=rate,
                                     mean_acceptance_length=mean_len)


@dataclass
class Accounting:
    """Per-choice final counters, summed into usage and speculation once every choice has finished."""

    prompt_tokens: int
    num_choices: int
    predicted: bool = False  # the request has a prediction: usage says how much of it the reply took
    finished: dict[int, ChoiceEvent] = field(default_factory=dict)
    latest: dict[int, ChoiceEvent] = field(default_factory=dict)  # each choice's last event so far

    def record(self, event: ChoiceEvent) -> None:
        self.latest[event.index] = event
        if event.finish_reason is not None:
            self.finished[event.index] = event

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.num_choices

    def usage(self) -> s.Usage:
        return self._usage(self.finished.values())

    def usage_so_far(self) -> s.Usage:
        """Usage while choices still run (stream_options.continuous_usage_stats): the tokens generated so far."""
        return self._usage(self.latest.values())

    def _usage(self, events: Iterable[ChoiceEvent]) -> s.Usage:
        events = list(events)
        completion = sum(e.completion_tokens for e in events)
        # the prompt counts once for all choices, and its cached tokens as the fewest any choice found
        cached = min((e.cached_tokens for e in events), default=0)
        details = None
        if self.predicted:  # drafted from the prediction: accepted, or verified and not taken
            accepted = sum(e.speculation.num_accepted_tokens for e in events if e.speculation is not None)
            drafted = sum(e.speculation.num_draft_tokens for e in events if e.speculation is not None)
            details = s.CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                                rejected_prediction_tokens=drafted - accepted)
        return s.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                       total_tokens=self.prompt_tokens + completion,
                       prompt_tokens_details=s.PromptTokensDetails(cached_tokens=cached),
                       completion_tokens_details=details)

    def speculation(self) -> SpecTotals:
        totals = SpecTotals()
        for event in self.finished.values():
            totals.add(event.speculation)
        return totals


@dataclass(frozen=True)
class PromptReturn:
    """What a response returns of the prompt itself: `echo` (its text before each choice's; with
    `echo_logprobs`, its tokens before the generated ones in the choice's logprobs, the first with null values, as
    OpenAI and vLLM return them) and vLLM's `prompt_logprobs` (alternatives per position, None: not asked)."""

    echo: bool = False
    echo_logprobs: int | None = None  # the request's `logprobs` when echo is on
    prompt_logprobs: int | None = None

    @property
    def wire(self) -> int | None:
        """SamplingParams.prompt_logprobs to ask the verifier for: enough alternatives for both uses."""
        asked = [n for n in (self.echo_logprobs, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None


def joined(first: s.CompletionLogprobs, second: s.CompletionLogprobs) -> s.CompletionLogprobs:
    return s.CompletionLogprobs(tokens=first.tokens + second.tokens,
                                token_logprobs=first.token_logprobs + second.token_logprobs,
                                top_logprobs=first.top_logprobs + second.top_logprobs,
                                text_offset=first.text_offset + second.text_offset)


class LogprobFormatter:
    """Token strings for logprobs come from decoding single tokens (partial characters show as U+FFFD, as in
    OpenAI's API, with the token's own bytes alongside for chat: `token_bytes`, token_bytes.py; None: its text's
    UTF-8); every logprob is finite (LOGPROB_FLOOR for -inf)."""

    def __init__(self, token_text: Callable[[int], str],
                 token_bytes: Callable[[int], list[int]] | None = None) -> None:
        self._text = token_text
        self._bytes = token_bytes or (lambda token_id: list(token_text(token_id).encode("utf-8")))

    def completion(self, logprobs: list[Any], offset: int) -> s.CompletionLogprobs:
        out = s.CompletionLogprobs()
        for lp in logprobs:
            token = self._text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(finite_logprob(lp.logprob))
            out.top_logprobs.append(self._top(lp.token_id, lp.logprob, lp.top))
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _top(self, token_id: int, logprob: float, top: list[Any]) -> dict[str, float]:
        """A legacy `top_logprobs` entry: the chosen token first, then the `logprobs` most likely ones, as OpenAI and
        vLLM return it (so `logprobs: 0` still names the chosen token; up to `logprobs` + 1 entries)."""
        entry = {self._text(token_id): finite_logprob(logprob)}
        for alternative in top:
            entry.setdefault(self._text(alternative.token_id), finite_logprob(alternative.logprob))
        return entry

    def echoed_prompt(self, prompt_ids: list[int], entries: list[Any], num_top: int) -> s.CompletionLogprobs:
        """The prompt's tokens in the legacy logprobs shape, offsets from 0: the first token has no context to
        be scored in, so its token_logprob and top_logprobs are null; `entries` (the verifier's prompt logprobs)
        score the others."""
        if len(entries) != max(len(prompt_ids) - 1, 0):
            raise ValueError(f"{len(entries)} prompt logprobs for a prompt of {len(prompt_ids)} tokens")
        out = s.CompletionLogprobs()
        offset = 0
        for j, token_id in enumerate(prompt_ids):
            token = self._text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if j == 0:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            entry = entries[j - 1]
            out.token_logprobs.append(finite_logprob(entry.logprob))
            out.top_logprobs.append(self._top(token_id, entry.logprob, entry.top[:num_top]))
        return out

    def prompt_logprobs(self, entries: list[Any], num_top: int) -> s.PromptLogprobs:
        """vLLM's shape: None for the first prompt token, then per token {token id: logprob, rank, text} for the
        prompt token itself and its `num_top` most likely alternatives."""
        out: s.PromptLogprobs = [None]
        for entry in entries:
            tokens = {str(entry.token_id): s.PromptLogprob(logprob=finite_logprob(entry.logprob),
                                                            rank=entry.rank or None,
                                                            decoded_token=self._text(entry.token_id))}
            for rank, top in enumerate(entry.top[:num_top], start=1):
                tokens.setdefault(str(top.token_id), s.PromptLogprob(logprob=finite_logprob(top.logprob), rank=rank,
                                                                     decoded_token=self._text(top.token_id)))
            out.append(tokens)
        return out

    def chat(self, logprobs: list[Any]) -> s.ChatLogprobs:
        content = []
        for lp in logprobs:
            token = self._text(lp.token_id)
            tops = [s.TopLogprob(token=self._text(t.token_id), logprob=finite_logprob(t.logprob),
                                 bytes=self._bytes(t.token_id)) for t in lp.top]
            content.append(s.ChatTokenLogprob(token=token, logprob=finite_logprob(lp.logprob),
                                              bytes=self._bytes(lp.token_id), top_logprobs=tops))
        return s.ChatLogprobs(content=content)
