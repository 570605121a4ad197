"""Engine settings that are not properties of the model runner (slots and context length live there)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_num_batched_tokens: int = 512  # prompt tokens prefilled per step (beyond the decode rows' tokens)
    max_waiting_requests: int = 256  # queue bound; beyond it add_request raises EngineOverloadedError
    draft_timeout_s: float = 0.5  # per-step deadline for each proposer; a late proposal means K = 0 this step
    log_stats_interval_s: float = 10.0  # 0 disables the periodic speculation log line
    # In batches, draft only positions whose estimated acceptance probability is at least this (see
    # step_planning.adaptive_draft_length); a request decoding alone always drafts its full K. Off by default: on the
    # benchmark it helped low-acceptance batches (HumanEval x8) and cost high-acceptance ones (code edit x8).
    adaptive_speculation: bool = False
    adaptive_min_accept_probability: float = 0.3

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.draft_timeout_s <= 0:
            raise ValueError("draft_timeout_s must be > 0")
