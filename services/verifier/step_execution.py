"""The tensor work of one engine step, run on the compute thread: prefill chunks, one batched forward over every
decoding row ([last committed token, x1..xK] each), batched verification (rejection.py), and rolling each row's
KV back to its accepted length. Pure functions of the runner and the step's plan; the engine commits the
returned rows on its loop thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.modeling.runner import ModelRunner, RowInput
from services.verifier.draft_collection import NO_DRAFT, ProposedDraft
from services.verifier.outputs import TokenLogprob
from services.verifier.rejection import verify
from services.verifier.request_state import RequestState
from services.verifier.sampling_batch import SamplingBatch
from services.verifier.step_cost import StepShape
from services.verifier.step_planning import PrefillChunk, group_by_length

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledRow:
    state: RequestState
    tokens: list[int]  # emitted, before stop handling
    num_draft: int
    num_accepted: int
    logprobs: list[TokenLogprob] | None


@dataclass(frozen=True)
class StepResult:
    rows: list[SampledRow]
    failures: list[tuple[RequestState, Exception]]
    # The decode rows' forward and verification: its shape and seconds, for the step-cost model (None when the
    # step had no decode rows or ran row by row after a fault).
    verify_timing: tuple[StepShape, float] | None = None


def execute_isolating_faults(
    runner: ModelRunner, prefill: Sequence[PrefillChunk], decode: Sequence[RequestState], drafts: Sequence[ProposedDraft]
) -> StepResult:
    """The step batched; if that raises, every row again on its own, so a fault that one request causes (a
    value admission missed) fails that request only. Rows re-run apart emit what they would have in the
    batch: their noise is keyed by position, not by batch composition."""
    states = [chunk.state for chunk in prefill] + list(decode)
    lengths = {state.request_id: runner.length(state.request_id) for state in states}
    timing: list[tuple[StepShape, float]] = []
    try:
        rows = execute(runner, prefill, decode, drafts, timing)
        return StepResult(rows, [], timing[0] if timing else None)
    except Exception:  # located below
        logger.exception("an engine step over %d requests failed; running them one by one", len(states))
    parts = [([chunk], [], []) for chunk in prefill]
    parts += [([], [state], [draft]) for state, draft in zip(decode, drafts, strict=True)]
    rows, failures = [], []
    for state, part in zip(states, parts, strict=True):
        runner.truncate(state.request_id, lengths[state.request_id])  # undo the failed attempt's K/V
        try:
            rows += execute(runner, *part)
        except Exception as error:  # noqa: BLE001 - this request's own fault
            logger.error("request %s fails the engine step: %r", state.request_id, error)
            runner.truncate(state.request_id, lengths[state.request_id])
            failures.append((state, error))
    return StepResult(rows, failures)

def execute(
    runner: ModelRunner,
    prefill: Sequence[PrefillChunk],
    decode: Sequence[RequestState],
    drafts: Sequence[ProposedDraft],
    timing: list[tuple[StepShape, float]] | None = None,
) -> list[SampledRow]:
    """The step's rows; with `timing`, appends the decode rows' (shape, seconds) from the start of their forward
    to the results on the host (the transfer waits for an accelerator to finish)."""
    vocab = runner.vocab_size
    first_token_logits: list[tuple[RequestState, torch.Tensor]] = []
    for group in group_by_length([len(c.tokens) for c in prefill]):
        chunks = [prefill[i] for i in group]
        out = runner.forward([RowInput(c.state.request_id, c.tokens, num_logits=int(c.final)) for c in chunks])
        first_token_logits += [(c.state, out.logits[b, :1]) for b, c in enumerate(chunks) if c.final]  # [1, V]

    states = list(decode) + [state for state, _ in first_token_logits]
    if not states:
        return []
    max_k = max((len(d.tokens) for d in drafts), default=0)
    parts = []
    started = time.perf_counter()
    if decode:
        rows = [
            RowInput(s.request_id, [s.token_ids[-1], *d.tokens], num_logits=1 + len(d.tokens))
            for s, d in zip(decode, drafts, strict=True)
        ]
        parts.append(runner.forward(rows).logits)  # [Bd, K+1, V]
    for _, logits in first_token_logits:
        parts.append(logits[None])  # [1, 1, V]
    logits = torch.cat(
        [torch.nn.functional.pad(p, (0, 0, 0, max_k + 1 - p.shape[1])) for p in parts]
    )  # [B, K+1, V]

    all_drafts = list(drafts) + [NO_DRAFT] * len(first_token_logits)
    device = logits.device
    draft_tokens = torch.tensor(
        [d.tokens + [0] * (max_k - len(d.tokens)) for d in all_drafts], dtype=torch.int64, device=device
    ).reshape(len(states), max_k)
    num_draft = torch.tensor([len(d.tokens) for d in all_drafts], dtype=torch.int64, device=device)
    positions = torch.tensor([len(s.token_ids) for s in states], dtype=torch.int64, device=device)
    draft_probs = has_probs = None
    if any(d.probs is not None for d in all_drafts):
        draft_probs = torch.zeros(len(states), max_k, vocab, dtype=torch.float32, device=device)
        for b, d in enumerate(all_drafts):
            if d.probs is not None:
                draft_probs[b, : len(d.tokens)] = d.probs.to(device=device, dtype=torch.float32)
        has_probs = torch.tensor([d.probs is not None for d in all_drafts], device=device)
    batch = SamplingBatch.build(
        [s.request.sampling for s in states],
        [s.seed for s in states],
        vocab,
        device,
        [s.output_counts for s in states],
        [s.prompt_mask for s in states],
    )
    result = verify(logits, draft_tokens, num_draft, positions, batch, draft_probs, has_probs)

    tokens = result.tokens.tolist()  # the step's one host transfer of results
    accepted = result.num_accepted.tolist()
    wants_logprobs = any(s.request.sampling.logprobs is not None for s in states)
    logprobs = result.logprobs.tolist() if wants_logprobs else None
    top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
    if timing is not None and decode:
        width = max_k + 1
        timing.append((StepShape(len(decode), width, max(len(s.token_ids) for s in decode) + width),
                       time.perf_counter() - started))

    rows_out = []
    for b, (state, draft) in enumerate(zip(states, all_drafts, strict=True)):
        n_acc = accepted[b]
        if b < len(decode):
            runner.truncate(state.request_id, len(state.token_ids) + n_acc)  # drop rejected drafts' K/V
        emitted = tokens[b][: n_acc + 1]
        entries = None
        wanted = state.request.sampling.logprobs
        if wanted is not None:
            entries = [
                TokenLogprob(
                    token_id=t,
                    logprob=logprobs[b][j],
                    top=tuple(zip(top_ids[b][j][:wanted], top_lp[b][j][:wanted], strict=True))
                    if wanted and top_ids is not None
                    else (),
                )
                for j, t in enumerate(emitted)
            ]
        rows_out.append(SampledRow(state, emitted, len(draft.tokens), n_acc, entries))
    return rows_out
