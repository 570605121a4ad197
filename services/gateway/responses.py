"""Shaping ChoiceEvents into OpenAI objects: whole responses, SSE chunks, logprobs, usage and the
`speculative_decoding` extension. Kept apart from the HTTP routes so both endpoints share one accounting."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=False)
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
    finished: dict[int, ChoiceEvent] = field(default_factory=dict)

    def record(self, event: ChoiceEvent) -> None:
        if event.finish_reason is not None:
            self.finished[event.index] = event

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.num_choices

    def usage(self) -> s.Usage:
        completion = sum(e.completion_tokens for e in self.finished.values())
        return s.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                       total_tokens=self.prompt_tokens + completion)

    def speculation(self) -> SpecTotals:
        totals = SpecTotals()
        for event in self.finished.values():
            totals.add(event.speculation)
        return totals


class LogprobFormatter:
    """Token strings for logprobs come from decoding single tokens (partial characters show as U+FFFD, as in
    OpenAI's API, with the raw bytes alongside for chat); every logprob is finite (LOGPROB_FLOOR for -inf)."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._text = token_text

    def completion(self, logprobs: list[Any], offset: int) -> s.CompletionLogprobs:
        out = s.CompletionLogprobs()
        for lp in logprobs:
            token = self._text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(finite_logprob(lp.logprob))
            out.top_logprobs.append({self._text(t.token_id): finite_logprob(t.logprob) for t in lp.top})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def chat(self, logprobs: list[Any]) -> s.ChatLogprobs:
        content = []
        for lp in logprobs:
            token = self._text(lp.token_id)
            tops = [s.TopLogprob(token=(t_text := self._text(t.token_id)), logprob=finite_logprob(t.logprob),
                                 bytes=list(t_text.encode())) for t in lp.top]
            content.append(s.ChatTokenLogprob(token=token, logprob=finite_logprob(lp.logprob),
                                              bytes=list(token.encode()),
                                              top_logprobs=tops))
        return s.ChatLogprobs(content=content)
