"""What one engine step will do, decided before any tensor work: which prompt chunks to prefill, the most draft
tokens each decoding request may verify, and how prefill chunks share padded forwards. Pure functions of the
requests' state and the engine's limits, so they are tested and changed without an engine."""

from __future__ import annotations

from collections.abc import Sequence
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


def speculation_cap(state: RequestState, max_model_len: int) -> int:
    """The most draft tokens this row may verify this step: its own K, within the output budget and the
    context (the last position is kept for the token the step samples). speculation_planner.py picks how many
    of them are worth verifying."""
    spec = state.request.speculation
    if not spec.enabled:
        return 0
    room_in_output = state.request.sampling.max_tokens - state.num_output_tokens - 1
    room_in_context = max_model_len - len(state.token_ids) - 1
    return max(0, min(spec.num_speculative_tokens, room_in_output, room_in_context))


def plan_prefill(running: Sequence[RequestState], decode_tokens: int, max_num_batched_tokens: int) -> list[PrefillChunk]:
    """Prompt chunks for this step, in running order, within the token budget left by the decode rows
    (`decode_tokens` = their 1 + K each), but never less than a quarter of it, so prompts keep moving."""
    budget = max(max_num_batched_tokens - decode_tokens, max_num_batched_tokens // 4, 1)
    chunks = []
    for state in running:
        if not state.prefilling or budget == 0:
            continue
        start, target = state.num_computed, state.prefill_target
        n = min(target - start, budget)
        budget -= n
        tokens = state.token_ids[start : start + n]
        chunks.append(PrefillChunk(state, tokens, final=start + n == target, start=start,
                                   resumes=state.num_output_tokens > 0))
    return chunks
