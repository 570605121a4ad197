"""Mutable state of one request inside the engine (owned by the engine's event-loop thread)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.common.token_history import TokenHistory, TokenView
from services.verifier.kept_states import KeptStates
from services.verifier.outputs import FinishReason, RequestOutput, SpecDecodeCounts, TokenLogprob
from services.verifier.row_speculation import RowSpeculation
from services.verifier.sampling_params import GenerationRequest
from services.verifier.structured_output import OutputConstraint


class OutputSink(Protocol):
    """Where the engine puts a request's outputs: its own asyncio.Queue (read by its RequestStream), or a sink that
    gathers many requests' outputs (request_mux.py). A failure is put as an exception; nothing follows it or an
    output with a finish reason."""

    def put_nowait(self, item: RequestOutput | Exception) -> None: ...


@dataclass
class RequestState:
    request: GenerationRequest
    seed: int
    token_ids: list[int]  # prompt + committed output
    outputs: asyncio.Queue[RequestOutput] | OutputSink
    num_computed: int = 0  # tokens whose K/V are in the runner's cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (usage's cached_tokens)
    num_preemptions: int = 0  # times its KV blocks were taken back for others (kv_scheduling.py)
    finish_reason: FinishReason | None = None
    output_counts: torch.Tensor | None = None  # [V] float32, penalties only
    prompt_mask: torch.Tensor | None = None  # [V] bool, penalties only
    spec: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    has_slot: bool = False
    speculation: RowSpeculation | None = None  # set at admission when the request speculates
    # Scored prompt tokens so far when the request asked prompt_logprobs (filled chunk by chunk during prefill,
    # handed out with the first output, then None); None otherwise.
    prompt_logprobs: list[TokenLogprob] | None = None
    # The request's grammar and logit bias (structured_output.py); None when it has neither.
    constraint: OutputConstraint | None = None
    # The target's hidden states of committed tokens, in order, when a proposer needs them or they are extracted
    # (rows [n, H] on the host, or in the runner until read: runner_kept_states.py); None otherwise.
    hidden: KeptStates | None = None
    # Whether its settings let a captured step verify it (captured_verify.settings_fit), cached on first use
    fits_verify_tail: bool | None = field(default=None, init=False, repr=False, compare=False)
    # token_ids again as int64 rows, for proposers (committed_view); caught up with token_ids when read
    _history: TokenHistory | None = field(default=None, init=False, repr=False, compare=False)
    # The request's id and prompt length, read several times a row each step: plain attributes, not properties
    # over `request` (a property chain cost about three times an attribute read).
    request_id: str = field(init=False, repr=False, compare=False)
    num_prompt_tokens: int = field(init=False, repr=False, compare=False)
    # What bounds its drafts (step_planning.speculation_cap, read for every row at every step): its K, 0 when it
    # does not speculate, and the length its token_ids may reach by max_tokens (prompt + max_tokens).
    speculative_tokens: int = field(init=False, repr=False, compare=False)
    output_end: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.request_id = self.request.request_id
        self.num_prompt_tokens = len(self.request.prompt_token_ids)
        speculation = self.request.speculation
        self.speculative_tokens = speculation.num_speculative_tokens if speculation.enabled else 0
        self.output_end = self.num_prompt_tokens + self.request.sampling.max_tokens

    def committed_view(self) -> TokenView:
        """token_ids as a read-only snapshot that `np.asarray` reads without a copy (token_history.py), for
        proposers: an in-process n-gram drafter converted the whole list every step (20-80 us a row at 300-1,000
        tokens on a 2-core EPYC, every row of every step). The history catches up with the tokens appended since
        the last call, so a step converts only those; token_ids is append-only (one row of a step commits at a
        time), and one that grew shorter is read again whole."""
        history = self._history
        if history is None or len(history) > len(self.token_ids):
            history = self._history = TokenHistory(self.token_ids)
        elif len(history) < len(self.token_ids):
            history.extend(self.token_ids[len(history) :])
        return history.view()

    def hidden_states(self) -> torch.Tensor | None:
        """[n, H]: rows for token_ids[:n] (every committed token the target has run on), or None. A view: a step
        appends only the rows it committed, never copying the history (kept_states.py)."""
        return None if self.hidden is None else self.hidden.view()

    def takes_step_states(self, drafting: bool = False) -> bool:
        """The step about to run hands this request the states of what it commits (`drafting`: its row verifies a
        draft in it; KeptStates.takes_step_states). Asked before the step's forward."""
        return self.hidden is not None and self.hidden.takes_step_states(drafting)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prefill_target(self) -> int:
        """Tokens whose K/V must be in the cache before the request decodes: its prompt, or, resuming after a
        preemption with output committed, every token but the last (the decode row feeds that one)."""
        length = len(self.token_ids)
        return length - 1 if length > self.num_prompt_tokens else self.num_prompt_tokens

    @property
    def prefilling(self) -> bool:
        """The prefill target is not fully in the cache yet (decode rows always hold len(token_ids) - 1 tokens)."""
        return self.num_computed < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
