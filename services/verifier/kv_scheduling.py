"""Who gets KV memory: admission by free blocks, blocks for every decoding row before a step, and preemption of
the newest request when the pool runs short (vLLM's recompute policy). Functions of the runner and the
requests' state; the engine calls them on its loop thread, while no forward runs.

A request's blocks for its whole prompt are taken when it is admitted, so chunked prefill never runs short; a
decoding row takes blocks for its committed tokens plus its most drafts before each step. When those are not
there, the newest running request gives its blocks back and waits at the head of the queue; when readmitted,
it recomputes its K/V, its published blocks usually still cached, so most of that is a prefix hit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from services.modeling.block_pool import KVCacheFullError
from services.modeling.runner import ModelRunner
from services.verifier.request_state import RequestState
from services.verifier.runner_kept_states import keeps_states

logger = logging.getLogger(__name__)

WATERMARK = 0.01  # of the pool's blocks kept free at admission while others run, for their growth (vLLM's)


def admit(runner: ModelRunner, state: RequestState, others_running: bool) -> bool:
    """Start the request's sequence, from its longest cached prefix, with blocks for all of its prefill; False,
    holding nothing, when the pool lacks them. A request that scores its prompt computes every position, so it
    takes no cached prefix; one that keeps the target's hidden states takes one where the runner keeps the states
    of cached positions (their states start its own, read from the runner when needed: runner_kept_states.py)."""
    target = state.prefill_target
    reuse = state.prompt_logprobs is None and (state.hidden is None or keeps_states(runner))
    cached = runner.add_sequence(state.request_id, state.token_ids[:target] if reuse else ())
    needed = runner.kv_blocks_needed(state.request_id, target)
    reserve = int(WATERMARK * runner.kv_usage.total_blocks) if others_running else 0
    if needed + reserve > runner.kv_blocks_available():
        runner.remove_sequence(state.request_id)
        return False
    runner.reserve(state.request_id, target)
    state.has_slot = True
    state.num_computed = cached
    if state.hidden is not None:
        state.hidden.attach()
    if not state.num_output_tokens:
        state.num_cached_tokens = cached
    return True


def reserve_decode(
    runner: ModelRunner,
    running: Sequence[RequestState],
    length_after_step: Callable[[RequestState], int],
    preempt: Callable[[RequestState], None],
) -> None:
    """Blocks for every decoding row's step, oldest request first; while the pool is short, `preempt` the newest
    running request (possibly the row itself, which then waits)."""
    preempted: set[str] = set()
    for state in list(running):
        if state.prefilling or state.request_id in preempted:
            continue
        while True:
            try:
                runner.reserve(state.request_id, length_after_step(state))
                break
            except KVCacheFullError:
                victim = running[-1]
                preempt(victim)
                preempted.add(victim.request_id)
                if victim is state:
                    break


def release_for_recompute(runner: ModelRunner, state: RequestState) -> None:
    """Give the request's blocks back; it will compute them again from the start (chunks of its committed tokens,
    sampling nothing: prefill_target). One still in its prompt scores and keeps states again from the start."""
    if state.hidden is not None and state.num_output_tokens:
        state.hidden.detach()  # states the runner still holds go with the slot: read them first
    runner.remove_sequence(state.request_id)
    state.has_slot = False
    state.num_computed = 0
    state.num_preemptions += 1
    if not state.num_output_tokens:
        if state.prompt_logprobs is not None:
            state.prompt_logprobs = []
        if state.hidden is not None:
            state.hidden = state.hidden.cleared()
    logger.info("request %s preempted (KV cache full): %d tokens to recompute when it resumes",
                state.request_id, state.prefill_target)
