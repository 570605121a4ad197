"""The verifier engine: continuous batching with speculative decoding, one batched verify forward per step.

A step (all on the asyncio loop, the tensor work in a worker thread so the loop keeps serving):
  1. admit waiting requests into free KV slots;
  2. ask each proposer, concurrently and under a deadline, for drafts of the decoding requests that use it
     (a missing or late draft means K = 0 for that row this step: slower, never wrong);
  3. prefill prompt chunks (bounded by max_num_batched_tokens), then one target forward over every decoding row
     ([last committed token, x1..xK] each, at the row's own offset);
  4. verify all rows at once (rejection.py), roll every row back to its accepted length, emit the tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

import torch

from services.common.proposer import Draft, DraftInput, Proposer
from services.modeling.runner import ModelRunner, RowInput
from services.verifier.engine_config import EngineConfig
from services.verifier.outputs import FinishReason, RequestOutput, SpecDecodeCounts, TokenLogprob
from services.verifier.proposer_outages import ProposerOutageLog
from services.verifier.random_streams import seed_to_int64
from services.verifier.rejection import verify
from services.verifier.request_state import RequestState
from services.verifier.sampling_batch import SamplingBatch
from services.verifier.sampling_params import GenerationRequest
from services.verifier.spec_stats import PeriodicStatsLogger, SpecDecodeStats

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later (maps to HTTP 503 / gRPC RESOURCE_EXHAUSTED, whose
    status says so: the message states only the facts, so a client's own advice is not repeated)."""


class RequestFailedError(RuntimeError):
    """The engine could not compute this request's next tokens (a server fault, gRPC INTERNAL); the requests that
    shared its step are not affected."""


class RequestIdInUseError(ValueError):
    """A running or waiting request already has this id (gRPC ALREADY_EXISTS)."""


@dataclass(frozen=True)
class _PrefillChunk:
    state: RequestState
    tokens: list[int]
    final: bool  # the last chunk samples the first output token


@dataclass(frozen=True)
class _ProposedDraft:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V]


_NO_DRAFT = _ProposedDraft([], None)


@dataclass(frozen=True)
class _SampledRow:
    state: RequestState
    tokens: list[int]  # emitted, before stop handling
    num_draft: int
    num_accepted: int
    logprobs: list[TokenLogprob] | None


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


def _compute_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-engine")


class RequestStream:
    """Async iterator over one request's outputs; ends after the output that carries a finish reason."""

    def __init__(self, engine: Engine, state: RequestState) -> None:
        self._engine = engine
        self._state = state
        self._done = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._state.outputs.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def ready_outputs(self) -> list[RequestOutput]:
        """The outputs available now, without waiting (for callers that drive Engine.step themselves)."""
        ready = []
        while not self._done and not self._state.outputs.empty():
            item = self._state.outputs.get_nowait()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._done = item.finished
            ready.append(item)
        return ready

    def abort(self) -> None:
        if not self._done:
            self._engine.abort(self.request_id)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        proposers: Mapping[str, Proposer] | None = None,
        eos_token_ids: Iterable[int] = (),
        compute: Executor | None = None,
    ) -> None:
        """compute: the executor that runs every forward (see services/modeling/compute_placement.py); its owner
        shuts it down. Without one the engine keeps a worker thread of its own."""
        self.runner = runner
        self.config = config or EngineConfig()
        self.proposers = dict(proposers or {})
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stats_by_method: dict[str, SpecDecodeStats] = {}  # speculation counts per proposer
        self._stats_logger = PeriodicStatsLogger(self.config.log_stats_interval_s)
        self._outages = ProposerOutageLog()
        self._states: dict[str, RequestState] = {}
        self._waiting: deque[RequestState] = deque()
        self._running: list[RequestState] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._seed_source = random.SystemRandom()
        # One thread for all tensor work: torch's OpenMP pool belongs to the calling thread, so every step reuses
        # one pool instead of waking the pools of several default-executor threads.
        self._owns_executor = compute is None
        self._executor = compute if compute is not None else _compute_thread()

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="specserve-engine")

    async def shutdown(self) -> None:
        """Abort every request and stop after the step in flight (a forward is never cut in half)."""
        for request_id in list(self._states):
            self.abort(request_id)
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._reap()
        if self._owns_executor:
            self._executor.shutdown(wait=True)
            self._executor = _compute_thread()  # threads start lazily, so the engine can be started again

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; raises ValueError for an invalid one and EngineOverloadedError on a full queue."""
        self._validate(request)
        capacity = self.config.max_waiting_requests + self.runner.num_free_slots()
        if len(self._waiting) >= capacity:
            raise EngineOverloadedError(
                f"the waiting queue is full: {len(self._waiting)} requests already waiting for "
                f"{self.runner.max_num_seqs} busy slots (max_waiting_requests={self.config.max_waiting_requests})"
            )
        seed = request.sampling.seed
        seed = seed_to_int64(seed) if seed is not None else self._seed_source.getrandbits(63)
        state = RequestState(
            request=request, seed=seed, token_ids=list(request.prompt_token_ids), outputs=asyncio.Queue()
        )
        self._states[request.request_id] = state
        self._waiting.append(state)
        self._wakeup.set()
        return RequestStream(self, state)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """add_request as an async generator that aborts the request if the consumer stops early."""
        stream = self.add_request(request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its slot is freed before the next step. False if unknown or already done."""
        state = self._states.get(request_id)
        if state is None or state.finished:
            return False
        self._finish(state, FinishReason.ABORT, [], None)
        if state in self._waiting:
            self._waiting.remove(state)
            del self._states[request_id]
        self._wakeup.set()
        return True

    def _validate(self, request: GenerationRequest) -> None:
        if request.request_id in self._states:
            raise RequestIdInUseError(f"request id {request.request_id!r} is already in use")
        prompt = request.prompt_token_ids
        limit = self.runner.max_model_len - 1
        if not prompt:
            raise ValueError("the prompt is empty; at least one token is needed")
        if len(prompt) > limit:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but this model accepts at most {limit} "
                f"(max_model_len={self.runner.max_model_len}, one position is kept for the first output token)"
            )
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        spec = request.speculation
        if spec.enabled and spec.method not in self.proposers:
            available = ", ".join(sorted(self.proposers)) or "none configured"
            raise ValueError(f"unknown speculative method {spec.method!r}; available: {available}")

    # -- the step loop --------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._closing:
            await self._wakeup.wait()
            self._reap()
            if self._closing:
                return
            if not self._waiting and not self._running:
                self._wakeup.clear()
                continue
            try:
                await self.step()
            except Exception as error:  # a bug must not leave clients waiting forever
                logger.exception("engine step failed; failing the running requests")
                for state in list(self._running):
                    if not state.finished:
                        state.finish_reason = FinishReason.ABORT
                        state.outputs.put_nowait(error)
                self._reap()

    async def step(self) -> None:
        """One engine step over every running request."""
        self._reap()
        self._admit()
        decode = [s for s in self._running if not s.prefilling]
        prefill = self._plan_prefill(decode)
        if not decode and not prefill:
            return
        drafts = await self._collect_drafts(decode)
        loop = asyncio.get_running_loop()
        rows, failures = await loop.run_in_executor(
            self._executor, self._execute_isolating_faults, prefill, decode, drafts
        )
        failed = {state.request_id for state, _ in failures}
        for chunk in prefill:
            if chunk.state.request_id not in failed:
                chunk.state.num_computed += len(chunk.tokens)
        for state, error in failures:
            self._fail(state, error)
        for row in rows:
            try:
                self._commit(row)
            except Exception as error:  # one row's bookkeeping fault fails that request only
                logger.exception("committing the output of request %s failed", row.state.request_id)
                self._fail(row.state, error)
        self._reap()
        if self._stats_logger.due():
            self._stats_logger.maybe_log(self.stats)

    def _admit(self) -> None:
        while self._waiting and self.runner.num_free_slots() > 0:
            state = self._waiting.popleft()
            self.runner.add_sequence(state.request_id)
            state.has_slot = True
            if state.request.sampling.uses_penalties:
                vocab, device = self.runner.vocab_size, self.runner.device
                state.output_counts = torch.zeros(vocab, dtype=torch.float32, device=device)
                state.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
                state.prompt_mask[torch.tensor(state.request.prompt_token_ids, device=device)] = True
            self._running.append(state)

    def _reap(self) -> None:
        """Free the slots of finished (and aborted) requests; only called while no forward is in flight."""
        for state in [s for s in self._running if s.finished]:
            self._running.remove(state)
            if state.has_slot:
                self.runner.remove_sequence(state.request_id)
                state.has_slot = False
            spec = state.request.speculation
            if spec.enabled:
                self.proposers[spec.method].release(state.request_id)
            self._states.pop(state.request_id, None)

    def _num_speculative(self, state: RequestState, num_decoding: int) -> int:
        """K for this step. Adaptive K applies only when several requests decode together: alone, a step reads
        the weights once whatever K is (extra draft positions are nearly free); in a batch, every rejected
        position is paid for by all rows."""
        spec = state.request.speculation
        if not spec.enabled:
            return 0
        room_in_output = state.request.sampling.max_tokens - state.num_output_tokens - 1
        room_in_context = self.runner.max_model_len - len(state.token_ids) - 1
        wanted = spec.num_speculative_tokens
        if self.config.adaptive_speculation and num_decoding > 1:
            acceptance = state.acceptance.rate
            wanted = adaptive_draft_length(acceptance, wanted, self.config.adaptive_min_accept_probability)
        return max(0, min(wanted, room_in_output, room_in_context))

    def _plan_prefill(self, decode: Sequence[RequestState]) -> list[_PrefillChunk]:
        budget_total = self.config.max_num_batched_tokens
        decode_tokens = sum(1 + self._num_speculative(s, len(decode)) for s in decode)
        budget = max(budget_total - decode_tokens, budget_total // 4, 1)
        chunks = []
        for state in self._running:
            if not state.prefilling or budget == 0:
                continue
            start = state.num_computed
            n = min(state.num_prompt_tokens - start, budget)
            budget -= n
            tokens = list(state.request.prompt_token_ids[start : start + n])
            chunks.append(_PrefillChunk(state, tokens, final=start + n == state.num_prompt_tokens))
        return chunks

    async def _collect_drafts(self, decode: Sequence[RequestState]) -> list[_ProposedDraft]:
        drafts = [_NO_DRAFT] * len(decode)
        groups: dict[str, list[tuple[int, int]]] = {}
        for index, state in enumerate(decode):
            k = self._num_speculative(state, len(decode))
            if k > 0:
                groups.setdefault(state.request.speculation.method, []).append((index, k))

        async def ask(method: str, members: list[tuple[int, int]]) -> None:
            inputs = [DraftInput(decode[i].request_id, decode[i].token_ids, k) for i, k in members]
            try:
                proposed = await asyncio.wait_for(
                    self.proposers[method].propose(inputs), timeout=self.config.draft_timeout_s
                )
            except TimeoutError:
                self._fall_back(method, f"missed the {self.config.draft_timeout_s:.3f} s draft deadline")
                return
            except Exception as error:  # noqa: BLE001 - any proposer failure means K = 0, never a failed step
                self._fall_back(method, error)
                return
            if len(proposed) != len(inputs):
                self._fall_back(method, f"returned {len(proposed)} drafts for {len(inputs)} sequences")
                return
            self._outages.succeeded(method)
            for (index, k), draft in zip(members, proposed, strict=True):
                drafts[index] = self._sanitize(draft, k)

        await asyncio.gather(*(ask(method, members) for method, members in groups.items()))
        return drafts

    @property
    def stats(self) -> SpecDecodeStats:
        """Engine-wide counts: the sum over proposers, assembled when asked (steps record per proposer only)."""
        return SpecDecodeStats.merged(list(self.stats_by_method.values()))

    def num_fallbacks(self, method: str) -> int:
        """Steps in which `method`'s proposal was late, failed or malformed (its rows ran with K = 0)."""
        stats = self.stats_by_method.get(method)
        return stats.num_fallbacks if stats is not None else 0

    def _method_stats(self, method: str) -> SpecDecodeStats:
        stats = self.stats_by_method.get(method)
        if stats is None:
            stats = self.stats_by_method[method] = SpecDecodeStats()
        return stats

    def _fall_back(self, method: str, error: BaseException | str) -> None:
        """`method`'s rows run with K = 0 this step: counted, and logged once per outage (proposer_outages)."""
        self._method_stats(method).num_fallbacks += 1
        self._outages.failed(method, error)

    def _sanitize(self, draft: Draft, k: int) -> _ProposedDraft:
        """Trust nothing from a proposer: clip to K, drop out-of-vocabulary drafts and malformed q."""
        tokens = [int(t) for t in list(draft.token_ids)[:k]]
        vocab = self.runner.vocab_size
        if not tokens or min(tokens) < 0 or max(tokens) >= vocab:
            return _NO_DRAFT
        probs = draft.probs
        if probs is not None and (probs.dim() != 2 or probs.shape[0] < len(tokens) or probs.shape[1] != vocab):
            probs = None
        return _ProposedDraft(tokens, None if probs is None else probs[: len(tokens)])

    # -- tensor work (worker thread) ------------------------------------------------------------------------
    def _execute_isolating_faults(
        self, prefill: Sequence[_PrefillChunk], decode: Sequence[RequestState], drafts: Sequence[_ProposedDraft]
    ) -> tuple[list[_SampledRow], list[tuple[RequestState, Exception]]]:
        """The step batched; if that raises, every row again on its own, so a fault that one request causes (a
        value admission missed) fails that request only. Rows re-run apart emit what they would have in the
        batch: their noise is keyed by position, not by batch composition. Returns (rows, failed requests)."""
        states = [chunk.state for chunk in prefill] + list(decode)
        lengths = {state.request_id: self.runner.length(state.request_id) for state in states}
        try:
            return self._execute(prefill, decode, drafts), []
        except Exception:  # located below
            logger.exception("an engine step over %d requests failed; running them one by one", len(states))
        parts = [([chunk], [], []) for chunk in prefill]
        parts += [([], [state], [draft]) for state, draft in zip(decode, drafts, strict=True)]
        rows, failures = [], []
        for state, part in zip(states, parts, strict=True):
            self.runner.truncate(state.request_id, lengths[state.request_id])  # undo the failed attempt's K/V
            try:
                rows += self._execute(*part)
            except Exception as error:  # noqa: BLE001 - this request's own fault
                logger.error("request %s fails the engine step: %r", state.request_id, error)
                self.runner.truncate(state.request_id, lengths[state.request_id])
                failures.append((state, error))
        return rows, failures

    def _execute(
        self, prefill: Sequence[_PrefillChunk], decode: Sequence[RequestState], drafts: Sequence[_ProposedDraft]
    ) -> list[_SampledRow]:
        runner = self.runner
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

        all_drafts = list(drafts) + [_NO_DRAFT] * len(first_token_logits)
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
            rows_out.append(_SampledRow(state, emitted, len(draft.tokens), n_acc, entries))
        return rows_out

    # -- bookkeeping (loop thread) --------------------------------------------------------------------------
    def _commit(self, row: _SampledRow) -> None:
        state = row.state
        if row.num_draft:
            state.num_computed = len(state.token_ids) + row.num_accepted
            state.spec.num_drafts += 1
            state.spec.num_draft_tokens += row.num_draft
            state.spec.num_accepted_tokens += row.num_accepted
            self._method_stats(state.request.speculation.method).record(row.num_draft, row.num_accepted)
            state.acceptance.observe(row.num_draft, row.num_accepted)
        elif not state.prefilling:
            state.num_computed = len(state.token_ids)
        if state.finished:  # aborted while the step ran
            return
        sampling = state.request.sampling
        emitted, reason = [], None
        for token in row.tokens:
            emitted.append(token)
            state.token_ids.append(token)
            if token in sampling.stop_token_ids or (token in self.eos_token_ids and not sampling.ignore_eos):
                reason = FinishReason.STOP
            elif state.num_output_tokens >= sampling.max_tokens or len(state.token_ids) >= self.runner.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if state.output_counts is not None:
            state.output_counts.index_add_(
                0,
                torch.tensor(emitted, device=state.output_counts.device),
                torch.ones(len(emitted), device=state.output_counts.device),
            )
        logprobs = row.logprobs[: len(emitted)] if row.logprobs is not None else None
        self._finish(state, reason, emitted, logprobs)

    def _fail(self, state: RequestState, error: Exception) -> None:
        """End one request with an error (its stream raises it); the other requests of the step go on."""
        if not state.finished:
            state.finish_reason = FinishReason.ABORT
            state.outputs.put_nowait(RequestFailedError(f"request {state.request_id} failed in the engine: {error!r}"))

    def _finish(
        self,
        state: RequestState,
        reason: FinishReason | None,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
    ) -> None:
        """Publish one output; with a reason, the request is done (its slot is freed by _reap)."""
        state.finish_reason = reason
        state.outputs.put_nowait(
            RequestOutput(
                request_id=state.request_id,
                token_ids=tuple(tokens),
                logprobs=None if logprobs is None else tuple(logprobs),
                finish_reason=reason,
                num_prompt_tokens=state.num_prompt_tokens,
                num_output_tokens=state.num_output_tokens,
                spec=SpecDecodeCounts(
                    state.spec.num_drafts, state.spec.num_draft_tokens, state.spec.num_accepted_tokens
                ),
            )
        )
