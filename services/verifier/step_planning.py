"""What one engine step will do, decided before any tensor work: which prompt chunks to prefill, how many draft
tokens each decoding request asks for, and how prefill chunks share padded forwards. Pure functions of the
requests' state and the engine's limits, so they are tested and changed without an engine."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.verifier.engine_config import EngineConfig
from services.verifier.request_state import RequestState


@dataclass(frozen=True)
class PrefillChunk:
    state: RequestState
    tokens: list[int]
    final: bool  # the last chunk samples the first output token


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


def adaptive_draft_length(acceptance: float, limit: int, min_accept_probability: float) -> int:
    """The longest K whose last draft position is still likely enough to be accepted.

    With per-token acceptance rate a (drafts accepted as a run, so position j survives with probability a**j),
    verifying position j is worth its cost while a**j >= min_accept_probability. A batch then stops paying K+1
    verify positions per row for requests whose drafts keep being rejected; the output never depends on K.
    """
    if acceptance >= 1.0:
        return limit
    if acceptance <= 0.0:
        return 1
    return max(1, min(limit, int(math.log(min_accept_probability) / math.log(acceptance))))



def speculative_length(state: RequestState, num_decoding: int, config: EngineConfig, max_model_len: int) -> int:
    """K for this step. Adaptive K applies only when several requests decode together: alone, a step reads
    the weights once whatever K is (extra draft positions are nearly free); in a batch, every rejected
    position is paid for by all rows."""
    spec = state.request.speculation
    if not spec.enabled:
        return 0
    room_in_output = state.request.sampling.max_tokens - state.num_output_tokens - 1
    room_in_context = max_model_len - len(state.token_ids) - 1
    wanted = spec.num_speculative_tokens
    if config.adaptive_speculation and num_decoding > 1:
        acceptance = state.acceptance.rate
        wanted = adaptive_draft_length(acceptance, wanted, config.adaptive_min_accept_probability)
    return max(0, min(wanted, room_in_output, room_in_context))


def plan_prefill(running: Sequence[RequestState], decode_tokens: int, max_num_batched_tokens: int) -> list[PrefillChunk]:
    """Prompt chunks for this step, in running order, within the token budget left by the decode rows
    (`decode_tokens` = their 1 + K each), but never less than a quarter of it, so prompts keep moving."""
    budget = max(max_num_batched_tokens - decode_tokens, max_num_batched_tokens // 4, 1)
    chunks = []
    for state in running:
        if not state.prefilling or budget == 0:
            continue
        start = state.num_computed
        n = min(state.num_prompt_tokens - start, budget)
        budget -= n
        tokens = list(state.request.prompt_token_ids[start : start + n])
        chunks.append(PrefillChunk(state, tokens, final=start + n == state.num_prompt_tokens))
    return chunks
