"""Mutable state of one request inside the engine (owned by the engine's event-loop thread)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from services.verifier.outputs import FinishReason, RequestOutput, SpecDecodeCounts
from services.verifier.sampling_params import GenerationRequest


@dataclass
class AcceptanceEstimate:
    """Recent per-token acceptance rate of a request's drafts (geometric model: accepted tokens over accepted
    tokens plus rejection events), with exponential forgetting and an optimistic prior so that a new request
    starts with long drafts."""

    accepted: float = 4.0
    rejected: float = 1.0
    decay: float = 0.9

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1.0 if num_accepted < num_draft else 0.0)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class RequestState:
    request: GenerationRequest
    seed: int
    token_ids: list[int]  # prompt + committed output
    outputs: asyncio.Queue[RequestOutput]
    num_computed: int = 0  # tokens whose K/V are in the runner's cache
    finish_reason: FinishReason | None = None
    output_counts: torch.Tensor | None = None  # [V] float32, penalties only
    prompt_mask: torch.Tensor | None = None  # [V] bool, penalties only
    spec: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    has_slot: bool = False
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prefilling(self) -> bool:
        """The prompt is not fully in the cache yet (decode rows always hold len(token_ids) - 1 tokens)."""
        return self.num_computed < self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
