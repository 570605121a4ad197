"""Engine settings that are not properties of the model runner (slots and context length live there)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.verifier.step_cost_cache import StepCostCache


@dataclass(frozen=True)
class EngineConfig:
    max_num_batched_tokens: int = 512  # prompt tokens prefilled per step (beyond the decode rows' tokens)
    max_waiting_requests: int = 256  # queue bound; beyond it add_request raises EngineOverloadedError
    draft_timeout_s: float = 0.5  # per-step deadline for each proposer; a late proposal means K = 0 this step
    # The deadline grows with what a proposer's calls take (draft_deadline.py), up to this: a draft model's K
    # forwards may take longer than draft_timeout_s, and a missed deadline costs more than waiting. Below
    # draft_timeout_s it means draft_timeout_s (a fixed deadline).
    max_draft_timeout_s: float = 2.0
    log_stats_interval_s: float = 10.0  # 0 disables the periodic speculation log line
    # Verify only the draft positions expected to pay for their share of the step (speculation_planner.py);
    # off: every row verifies its full K whenever its proposer has a draft.
    adaptive_speculation: bool = True
    # Time a few verify shapes at start-up so the first steps already know what width costs (step_cost.py);
    # without it the planner learns costs from the steps it runs, starting at full K.
    profile_step_cost: bool = True
    # Reuse a stored profile measured on the same machine and setup, and store a new one (step_cost_cache.py);
    # None: measure at every start.
    step_cost_cache: StepCostCache | None = None
    # extract_hidden_states: write every finished request's token ids and target hidden states here
    # (hidden_state_files.py); None: off.
    extract_hidden_states_dir: Path | None = None
    # The target layers whose hidden states drafters (and extract_hidden_states) receive (hidden_layers.py); None:
    # the layers the attached drafters declare, else the final one (served_hidden_layers.py)
    hidden_layers: tuple[int, ...] | None = None
    # vLLM's --max-logprobs: the most alternatives a request may ask per position (logprobs, prompt_logprobs);
    # -1: the whole vocabulary
    max_logprobs: int = 20
    # vLLM's --seed: the seeds of the requests that give none are drawn from a generator seeded with it, so a fresh
    # engine sent the same requests in the same order samples the same tokens; None: fresh system randomness
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.max_logprobs < -1:
            raise ValueError("max_logprobs must be -1 (the vocabulary) or >= 0")
        if self.draft_timeout_s <= 0:
            raise ValueError("draft_timeout_s must be > 0")
