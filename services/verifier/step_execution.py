"""The tensor work of one engine step, run on the compute thread: prefill chunks, one batched forward over every
decoding row ([last committed token, x1..xK] each), batched verification (rejection.py), and rolling each row's
KV back to its accepted length. Pure functions of the runner and the step's plan; the engine commits the
returned rows on its loop thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from services.modeling.host_copies import DeviceToHost, to_device
from services.modeling.runner import ModelRunner, RowInput
from services.verifier import captured_verify
from services.verifier.draft_collection import NO_DRAFT, ProposedDraft
from services.verifier.draft_trees import (
    best_lines,
    fed_parents,
    fed_rows,
    line_length_through,
    line_through,
    verify_lines,
)
from services.verifier.kept_states import RowStates, StepStates
from services.verifier.outputs import TokenLogprob
from services.verifier.prompt_scoring import score_positions
from services.verifier.rejection import verify
from services.verifier.request_state import RequestState
from services.verifier.sampling_batch import SamplingBatch
from services.verifier.step_cost import StepShape
from services.verifier.step_planning import PrefillChunk, group_by_length
from services.verifier.structured_output import constrain_logits
from services.verifier.tree_rejection import QTreeRow, outcomes

logger = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen, as RequestOutput: one a row a step, 1.46 against 0.36 us to build here
class SampledRow:
    state: RequestState
    tokens: list[int]  # emitted, before stop handling
    num_draft: int
    num_accepted: int
    logprobs: list[TokenLogprob] | None
    # The target's hidden states of the committed tokens this step ran on ([last committed, accepted drafts]),
    # when the step hands them to the request (RequestState.takes_step_states); None otherwise.
    hidden: RowStates | None = None


PromptScores = tuple[RequestState, list[TokenLogprob]]  # one prefill chunk's scored prompt tokens


@dataclass(frozen=True)
class StepResult:
    rows: list[SampledRow]
    failures: list[tuple[RequestState, Exception]]
    # The decode rows' forward and verification: its shape and seconds, for the step-cost model (None when the
    # step had no decode rows or ran row by row after a fault).
    verify_timing: tuple[StepShape, float] | None = None
    # Prompt logprobs computed this step, per prefill chunk of a request that asked (prompt_scoring.py).
    prompt_scores: list[PromptScores] = field(default_factory=list)
    # The target's hidden states of each prefill chunk whose request takes them from its steps
    # (RequestState.takes_step_states).
    prefill_hidden: list[tuple[RequestState, torch.Tensor]] = field(default_factory=list)


def execute_isolating_faults(
    runner: ModelRunner, prefill: Sequence[PrefillChunk], decode: Sequence[RequestState],
    drafts: Sequence[ProposedDraft], launched: Callable[[], None] = lambda: None,
) -> StepResult:
    """The step batched; if that raises, every row again on its own, so a fault that one request causes (a
    value admission missed) fails that request only. Rows re-run apart emit what they would have in the
    batch: their noise is keyed by position, not by batch composition. `launched` is called once the step's
    device work is launched (a captured step's replay queued), or before a forward that runs on the host, and
    at the latest when this returns: the engine's loop waits for it (Engine.step says why)."""
    states = [chunk.state for chunk in prefill] + list(decode)
    lengths = {state.request_id: runner.length(state.request_id) for state in states}
    timing: list[tuple[StepShape, float]] = []
    scores: list[PromptScores] = []
    hidden: list[tuple[RequestState, torch.Tensor]] = []
    try:
        rows = execute(runner, prefill, decode, drafts, timing, scores, hidden, launched)
        return StepResult(rows, [], timing[0] if timing else None, scores, hidden)
    except Exception:  # located below
        logger.exception("an engine step over %d requests failed; running them one by one", len(states))
    finally:
        launched()
    parts = [([chunk], [], []) for chunk in prefill]
    parts += [([], [state], [draft]) for state, draft in zip(decode, drafts, strict=True)]
    rows, failures, scores, hidden = [], [], [], []
    for state, part in zip(states, parts, strict=True):
        runner.truncate(state.request_id, lengths[state.request_id])  # undo the failed attempt's K/V
        part_scores: list[PromptScores] = []
        part_hidden: list[tuple[RequestState, torch.Tensor]] = []
        try:
            rows += execute(runner, *part, scores=part_scores, hidden=part_hidden)
            scores += part_scores
            hidden += part_hidden
        except Exception as error:  # noqa: BLE001 - this request's own fault
            logger.error("request %s fails the engine step: %r", state.request_id, error)
            runner.truncate(state.request_id, lengths[state.request_id])
            failures.append((state, error))
    return StepResult(rows, failures, prompt_scores=scores, prefill_hidden=hidden)


def prefill_chunks(
    runner: ModelRunner, prefill: Sequence[PrefillChunk], scores: list[PromptScores] | None,
    hidden: list[tuple[RequestState, torch.Tensor]] | None, to_host: DeviceToHost,
) -> list[tuple[RequestState, torch.Tensor]]:
    """Feed the prompt chunks; returns the last-position logits ([1, V]) of each final chunk whose request
    samples (max_tokens > 0). Chunks of requests that asked prompt_logprobs run in forwards of their own with
    logits at every position, scored here (appended to `scores`); the other chunks keep one position's logits,
    so they neither pay for scoring nor see their batch change because of it. The chunks' hidden states are
    appended to `hidden` through `to_host` (read them after its wait)."""
    first_token_logits: list[tuple[RequestState, torch.Tensor]] = []
    for scoring in (False, True):
        part = [c for c in prefill if is_scored(c) == scoring]
        for group in group_by_length([len(c.tokens) for c in part]):
            chunks = [part[i] for i in group]
            rows = [RowInput(c.state.request_id, c.tokens, len(c.tokens) if scoring else int(c.samples))
                    for c in chunks]
            output = runner.forward(rows)
            logits = output.logits  # [B, max num_logits, V]
            for b, (chunk, row) in enumerate(zip(chunks, rows, strict=True)):
                if hidden is not None and not chunk.resumes and chunk.state.takes_step_states():
                    hidden.append((chunk.state, to_host.queue(output.hidden_states[b, : len(chunk.tokens)])))
                if scoring:
                    prompt = chunk.state.request.prompt_token_ids
                    following = prompt[chunk.start + 1 : chunk.start + len(chunk.tokens) + 1]
                    entries = score_positions(logits[b, : row.num_logits], following,
                                              chunk.state.request.sampling.prompt_logprobs)
                    if scores is not None:
                        scores.append((chunk.state, entries))
                if chunk.samples:
                    last = row.num_logits - 1
                    first_token_logits.append((chunk.state, logits[b, last : last + 1].clone()))  # [1, V]
    return first_token_logits

def is_scored(chunk: PrefillChunk) -> bool:
    """The chunk's prompt positions are scored (prompt_logprobs), which a resumed request did before."""
    return chunk.state.request.sampling.prompt_logprobs is not None and not chunk.resumes


def execute(
    runner: ModelRunner,
    prefill: Sequence[PrefillChunk],
    decode: Sequence[RequestState],
    drafts: Sequence[ProposedDraft],
    timing: list[tuple[StepShape, float]] | None = None,
    scores: list[PromptScores] | None = None,
    hidden: list[tuple[RequestState, torch.Tensor]] | None = None,
    launched: Callable[[], None] = lambda: None,
) -> list[SampledRow]:
    """The step's rows; with `timing`, appends the decode rows' (shape, seconds) from the start of their forward
    to the results on the host (the transfer waits for an accelerator to finish); with `scores`, appends the
    prompt logprobs of the chunks whose requests asked for them. `launched`: see execute_isolating_faults (a step
    with prompt chunks calls it first: their eager forwards are long on a host)."""
    vocab = runner.vocab_size
    to_host = DeviceToHost()  # results and hidden states, read after the step's one wait
    if prefill:
        launched()
    first_token_logits = prefill_chunks(runner, prefill, scores, hidden, to_host)

    states = list(decode) + [state for state, _ in first_token_logits]
    if not states:
        to_host.wait()
        return []
    if not first_token_logits:
        rows = verified_in_graph(runner, decode, drafts, to_host, timing, launched)
        if rows is not None:
            return rows
    # A tree's first path only, where the runner cannot feed trees or one grammar matcher would walk its paths
    trees_ok = getattr(runner, "supports_trees", False)
    drafts = [d if trees_ok and s.constraint is None else d.first_path() for s, d in zip(decode, drafts, strict=True)]
    all_drafts = list(drafts) + [NO_DRAFT] * len(first_token_logits)
    lines = verify_lines(all_drafts)
    max_k = max(len(line.tokens) for line in lines)
    parts = []
    rows_with_states = rows_taking_states(decode, drafts)  # their states go out
    host_row = {b: i for i, b in enumerate(rows_with_states)}
    states_on_host = None
    started = time.perf_counter()
    if decode:
        rows = [
            RowInput(s.request_id, [s.token_ids[-1], *d.tokens], num_logits=1 + len(d.tokens),
                     parents=None if d.parents is None else fed_parents(d.parents))
            for s, d in zip(decode, drafts, strict=True)
        ]
        launched()
        verified = runner.forward(rows)
        if rows_with_states:
            states_on_host = to_host.queue(rows_of(verified.hidden_states, rows_with_states))
        if any(d.parents is not None for d in drafts):  # each path's logits, gathered along it
            index = to_device(torch.tensor([[line.state, f] for line in lines[: len(lines) - len(first_token_logits)]
                                            for f in line.fed + [line.fed[-1]] * (max_k + 1 - len(line.fed))]),
                              verified.logits.device)
            parts.append(verified.logits[index[:, 0], index[:, 1]].view(-1, max_k + 1, vocab))
        else:
            parts.append(verified.logits)  # [Bd, K+1, V]
    for _, logits in first_token_logits:
        parts.append(logits[None])  # [1, 1, V]
    logits = torch.cat(
        [torch.nn.functional.pad(p, (0, 0, 0, max_k + 1 - p.shape[1])) for p in parts]
    )  # [lines, K+1, V]

    line_states = [states[line.state] for line in lines]
    device = logits.device
    per_line = torch.tensor(  # one host-to-device copy: [drafts padded to max_k, their number, the next position]
        [line.tokens + [0] * (max_k - len(line.tokens)) + [len(line.tokens), len(s.token_ids)]
         for line, s in zip(lines, line_states, strict=True)], dtype=torch.int64)
    per_line = to_device(per_line, device)
    draft_tokens, num_draft, positions = per_line[:, :max_k], per_line[:, max_k], per_line[:, max_k + 1]
    # a q-tree's q is read by its own walk (tree_rejection.py), not by the chain rule along each of its paths
    line_probs = [None if all_drafts[line.state].parents is not None else all_drafts[line.state].probs
                  for line in lines]
    draft_probs, has_probs = draft_probabilities(
        [len(line.tokens) for line in lines], line_probs, [s.request.sampling.greedy for s in line_states], max_k,
        vocab, device)
    batch = SamplingBatch.build(
        [s.request.sampling for s in line_states],
        [s.seed for s in line_states],
        vocab,
        device,
        [s.output_counts for s in line_states],
        [s.prompt_mask for s in line_states],
    )
    dead_ends: dict[int, int] = {}
    if any(s.constraint is not None for s in line_states):
        dead_ends = constrain_logits(logits, [s.constraint for s in line_states], [line.tokens for line in lines],
                                     [s.token_ids[s.num_prompt_tokens :] for s in line_states])
    result = verify(logits, draft_tokens, num_draft, positions, batch, draft_probs, has_probs)

    # the step's one wait for the device: every result (and the hidden states queued above) moves in copies queued
    # behind the step's work, read once they have all landed
    wants_logprobs = any(s.request.sampling.logprobs is not None for s in states)
    on_host = [to_host.queue(tensor) if tensor is not None else None for tensor in (
        torch.cat([result.tokens, result.num_accepted[:, None]], dim=1), result.logprobs if wants_logprobs else None,
        result.top_logprobs, result.top_token_ids)]
    to_host.wait()
    results, logprobs, top_lp, top_ids = (None if tensor is None else tensor.tolist() for tensor in on_host)
    tokens, accepted = [row[:-1] for row in results], [row[-1] for row in results]
    if timing is not None and decode:
        timing.append((verify_shape(decode, drafts), time.perf_counter() - started))
    best = best_lines(lines, accepted, len(states))
    q_trees = [b for b, (state, draft) in enumerate(zip(decode, drafts, strict=True))
               if draft.parents is not None and draft.probs is not None and not state.request.sampling.greedy]
    if q_trees:
        walked = _walk_q_trees(q_trees, lines, drafts, result.log_probs, batch.seeds, decode)
        for b, (r, emitted, lps) in zip(q_trees, walked, strict=True):
            best[b], tokens[r], accepted[r] = r, emitted, len(emitted) - 1
            if logprobs is not None:
                logprobs[r] = lps

    rows_out = []
    kept_states: list[tuple[int, list[int]]] = []  # (decode row, its kept fed positions) whose states go out
    for b, (state, r) in enumerate(zip(states, best, strict=True)):
        line = lines[r]
        n_acc = accepted[r]
        emitted = tokens[r][: n_acc + 1]
        if r in dead_ends and n_acc >= dead_ends[r]:
            # The accepted drafts d1..dj reach a state where the output constraints allow nothing: commit them,
            # as the plain engine would have, and the next step fails the request at that committed state.
            j = dead_ends[r]
            n_acc, emitted = j - 1, tokens[r][:j]
        kept_fed = line.fed[: n_acc + 1]  # [last committed, accepted drafts]: where they are in the forward
        if b < len(decode):
            if all_drafts[b].parents is None:
                if n_acc < len(line.tokens):
                    runner.truncate(state.request_id, len(state.token_ids) + n_acc)  # drop rejected drafts' K/V
            else:
                runner.keep_path(state.request_id, len(state.token_ids) - 1, kept_fed)
        entries = None
        wanted = state.request.sampling.logprobs
        if wanted is not None:
            entries = [
                TokenLogprob(
                    token_id=t,
                    logprob=logprobs[r][j],
                    top=tuple(zip(top_ids[r][j][:wanted], top_lp[r][j][:wanted], strict=True))
                    if wanted and top_ids is not None
                    else (),
                )
                for j, t in enumerate(emitted)
            ]
        if b in host_row:  # [last committed, accepted drafts] ran through the target
            kept_states.append((b, kept_fed))
        rows_out.append(SampledRow(state, emitted, len(line.tokens), n_acc, entries))
    if kept_states:
        step_states = StepStates(states_on_host)
        for b, kept_fed in kept_states:
            rows_out[b].hidden = step_states.row(host_row[b], kept_fed)  # (dataclasses.replace: 3-5 us a row)
    return rows_out


def verified_in_graph(runner: ModelRunner, decode: Sequence[RequestState], drafts: Sequence[ProposedDraft],
                      to_host: DeviceToHost, timing: list[tuple[StepShape, float]] | None,
                      launched: Callable[[], None] = lambda: None) -> list[SampledRow] | None:
    """The decode rows' forward and verification as one captured graph (captured_verify.py), where the runner has
    one for this step and the rows need nothing beyond it; None, with nothing done, otherwise. The runner calls
    `launched` once its device work is queued (llama_runner: the replay; the bench's simulated device: once its
    logits and verification are computed)."""
    forward_with_tail = getattr(runner, "forward_with_tail", None)
    if forward_with_tail is None or not captured_verify.takes(decode, drafts, runner.vocab_size):
        return None
    started = time.perf_counter()
    rows = [RowInput(s.request_id, [s.token_ids[-1], *d.tokens], num_logits=1 + len(d.tokens),
                     parents=None if d.parents is None else fed_parents(d.parents))
            for s, d in zip(decode, drafts, strict=True)]
    rows_with_states = rows_taking_states(decode, drafts)
    tail = captured_verify.tail_for(decode, drafts)
    replayed = forward_with_tail(rows, tail, launched)
    if replayed is None:
        return None
    results, served = replayed
    states_on_host = to_host.queue(rows_of(served, rows_with_states)) if rows_with_states else None
    results = to_host.queue(results[: len(decode)])
    to_host.wait()  # the step's one wait
    results = results.tolist()
    if timing is not None:
        timing.append((verify_shape(decode, drafts), time.perf_counter() - started))
    host_row = {b: i for i, b in enumerate(rows_with_states)}
    step_states = StepStates(states_on_host) if rows_with_states else None
    out = []
    for b, (state, draft, result) in enumerate(zip(decode, drafts, results, strict=True)):
        emitted, n_acc, kept_fed = tail.read(result)
        num_draft = len(draft.tokens)
        if draft.parents is not None:
            runner.keep_path(state.request_id, len(state.token_ids) - 1, kept_fed)  # the accepted path's K/V in place
            num_draft = line_length_through(draft.parents, [fed - 1 for fed in kept_fed[1:]])  # as the eager path
        elif n_acc < len(draft.tokens):
            runner.truncate(state.request_id, len(state.token_ids) + n_acc)  # drop rejected drafts' K/V
        kept = slice(n_acc + 1) if draft.parents is None else kept_fed
        hidden = step_states.row(host_row[b], kept) if b in host_row else None
        out.append(SampledRow(state, emitted, num_draft, n_acc, None, hidden))
    return out


def verify_shape(decode: Sequence[RequestState], drafts: Sequence[ProposedDraft]) -> StepShape:
    """The decode rows' forward as the step-cost model sees it: rows, width (1 + the most drafts) and span."""
    width = max(len(d.tokens) for d in drafts) + 1
    return StepShape(len(decode), width, max(len(s.token_ids) for s in decode) + width)


def draft_probabilities(
    lengths: Sequence[int], probs: Sequence[torch.Tensor | None], greedy: Sequence[bool], max_k: int, vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each line's q ([lines, max_k, V] float32, its first `lengths[b]` rows filled) and which lines have one
    ([lines] bool), on `device`; (None, None) when no sampled line has q. A greedy line's q is left out: greedy
    rows accept by argmax and never read it (rejection.py). A remote drafter's q arrives on the host; it is put
    together there and sent in one copy from pinned memory, where a copy per line from ordinary memory made the
    host wait for the device once per line."""
    kept = [None if is_greedy else q for q, is_greedy in zip(probs, greedy, strict=True)]
    if all(q is None for q in kept):
        return None, None
    has = to_device(torch.tensor([q is not None for q in kept]), device)
    on_host = device.type == "cuda" and all(q.device.type == "cpu" for q in kept if q is not None)
    where = torch.device("cpu") if on_host else device
    assembled = torch.zeros(len(kept), max_k, vocab, dtype=torch.float32, device=where, pin_memory=on_host)
    for b, (n, q) in enumerate(zip(lengths, kept, strict=True)):
        if q is not None:
            assembled[b, :n] = q.to(device=where, dtype=torch.float32)
    return (to_device(assembled, device) if on_host else assembled), has


def _walk_q_trees(q_trees: Sequence[int], lines: Sequence, drafts: Sequence[ProposedDraft], log_probs: torch.Tensor,
                  seeds: torch.Tensor, decode: Sequence[RequestState]) -> list[tuple[int, list[int], list[float]]]:
    """For each sampled request whose drafter sent a q-tree: the line its accepted path runs along, the tokens it
    emits and their log-probabilities (tree_rejection.py), in place of the deterministic rule's outcome."""
    rows = []
    for b in q_trees:
        draft = drafts[b]
        line_index, offsets = fed_rows(lines, b, len(draft.tokens) + 1)
        where = to_device(torch.tensor([line_index, offsets]), log_probs.device)
        node_log_p = log_probs[where[0], where[1]]  # [n + 1, V]
        seed = seeds[line_index[0] : line_index[0] + 1]
        rows.append(QTreeRow(node_log_p, draft.tokens, draft.parents, draft.probs, seed, len(decode[b].token_ids)))
    walked = []
    for b, outcome in zip(q_trees, outcomes(rows), strict=True):
        r = line_through(lines, b, outcome.path)
        walked.append((r, [drafts[b].tokens[i] for i in outcome.path] + [outcome.token], outcome.logprobs))
    return walked


def rows_taking_states(decode: Sequence[RequestState], drafts: Sequence[ProposedDraft]) -> list[int]:
    """The decode rows (indices) the step hands the states of what they commit (RequestState.takes_step_states:
    asked before the forward, which moves the runner's lengths)."""
    return [b for b, (state, draft) in enumerate(zip(decode, drafts, strict=True))
            if state.takes_step_states(bool(draft.tokens))]


def rows_of(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows] ([len(rows), L, H']) gathered on the device, so that they move in one transfer (a transfer per
    row waited on an accelerator once per row: 64 rows, 64 syncs a step). Every fed position moves, since which are
    kept is known only once the step's accepted tokens are read; a few rows more of states cost less than a wait."""
    if rows == list(range(hidden.shape[0])):
        return hidden
    return hidden.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), hidden.device))
