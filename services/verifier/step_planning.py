"""What one engine step will do, decided before any tensor work: which prompt chunks to prefill, the most draft
tokens each decoding request may verify, and how prefill chunks share padded forwards. Pure functions of the
requests' state and the engine's limits, so they are tested and changed without an engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.verifier.request_state import RequestState


@dataclass(frozen=True)
class PrefillChunk:
    state: RequestState
    tokens: list[int]
    final: bool  # the last chunk of the prefill
    start: int  # position of tokens[0]
    # A request resuming after a preemption recomputes its committed tokens: it samples, scores and keeps
    # nothing from these chunks (its decode row feeds its last token next).
    resumes: bool = False

    @property
    def samples(self) -> bool:
        """The chunk gives the request's first output token."""
        return self.final and not self.resumes and self.state.request.sampling.max_tokens > 0


def group_by_length(lengths: Sequence[int], max_padding: float = 0.25) -> list[list[int]]:
    """Group prefill chunks into padded forwards whose padding stays under `max_padding` of the real tokens:
    similar lengths share one forward, a long chunk does not make many short ones pay for its width."""
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            group = groups[-1]
            width = lengths[group[0]]
            real = sum(lengths[i] for i in group) + lengths[index]
            if width * (len(group) + 1) <= (1 + max_padding) * real:
                group.append(index)
                continue
        groups.append([index])
    return groups


def speculation_cap(state: RequestState, max_model_len: int, drafter_limits: Mapping[str | None, int]) -> int:
    """The most draft tokens this row may verify this step, the one rule for the K a proposer is asked for: the
    request's own K, within its drafter's declared limit (`drafter_limits` by method: ProposerCapabilities.
    max_speculative_tokens; 0 or absent: none), the output budget and the context (the last position is kept for
    the token the step samples). speculation_planner.py picks how many of them are worth verifying. Read for every
    row at every step, from what the request fixed at its start (RequestState.speculative_tokens, output_end):
    read through the request's settings, the engine's caps took 160 us a step at 64 EAGLE-like rows and 76 at 64
    rows without speculation, now 86 and 31 (line profile of engine_host_cost's chat text, simulated H200 step)."""
    k = state.speculative_tokens
    if not k:
        return 0
    limit = drafter_limits.get(state.request.speculation.method, 0)
    if limit and limit < k:
        k = limit
    return max(0, min(k, min(state.output_end, max_model_len) - len(state.token_ids) - 1))


def plan_prefill(running: Sequence[RequestState], decode_tokens: int, max_num_batched_tokens: int) -> list[PrefillChunk]:
    """Prompt chunks for this step, within the token budget left by the decode rows (`decode_tokens` = their 1 + K
    each), but never less than a quarter of it, so prompts keep moving.

    Short prompts go first: a prompt whose rest fits in half the budget is prefilled whole in this step, ahead of
    long prompts that came before it, so a chat's first token does not wait behind other requests' multi-thousand-
    token prefills (vLLM's partial-prefill limits serve the same end). The oldest long prompt keeps at least a
    quarter of the budget every step, so a stream of short prompts cannot stall it; long prompts share what is left
    in arrival order. Chunks come back in running order."""
    budget = prefill_room(max_num_batched_tokens, decode_tokens)
    prefilling = [state for state in running if state.prefilling]
    short = [state for state in prefilling if remaining_prefill(state) <= budget // 2]
    long = [state for state in prefilling if remaining_prefill(state) > budget // 2]
    kept_for_long = min(remaining_prefill(long[0]), budget // 4) if long else 0
    sizes: dict[str, int] = {}
    for state in short:
        n = min(remaining_prefill(state), budget - kept_for_long)
        if n <= 0:
            break
        sizes[state.request_id] = n
        budget -= n
    for state in long:
        if budget <= 0:
            break
        n = min(remaining_prefill(state), budget)
        sizes[state.request_id] = n
        budget -= n
    chunks = []
    for state in prefilling:
        n = sizes.get(state.request_id, 0)
        if n:
            start, target = state.num_computed, state.prefill_target
            chunks.append(PrefillChunk(state, state.token_ids[start : start + n], final=start + n == target,
                                       start=start, resumes=state.num_output_tokens > 0))
    return chunks


def prefill_room(max_num_batched_tokens: int, decode_tokens: int) -> int:
    """The prompt tokens a step may prefill beside its decode rows' `decode_tokens`: the budget they leave, but
    never less than a quarter of it."""
    return max(max_num_batched_tokens - decode_tokens, max_num_batched_tokens // 4, 1)


@dataclass(frozen=True)
class PrefillBacklog:
    """The prompt tokens running requests still have to prefill, against the step's token budget: what a step's
    drafts compete with. Where the budget binds, every draft token fed pushes a prompt token to a later step."""

    waiting: int = 0
    max_num_batched_tokens: int = 1

    @classmethod
    def of(cls, prefilling: Sequence[RequestState], max_num_batched_tokens: int) -> PrefillBacklog:
        """`prefilling`: the running requests still prefilling."""
        return cls(sum(map(remaining_prefill, prefilling)), max_num_batched_tokens)

    def displaced(self, narrow_tokens: int, wide_tokens: int) -> int:
        """Prompt tokens a step whose decode rows feed `wide_tokens` leaves for a later step that one feeding
        `narrow_tokens` would have prefilled."""
        return max(0, self.prefilled(narrow_tokens) - self.prefilled(wide_tokens))

    def prefilled(self, decode_tokens: int) -> int:
        return min(self.waiting, prefill_room(self.max_num_batched_tokens, decode_tokens))


def remaining_prefill(state: RequestState) -> int:
    return state.prefill_target - state.num_computed
