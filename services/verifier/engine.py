"""The verifier engine: continuous batching with speculative decoding, one batched verify forward per step.

A step (all on the asyncio loop, the tensor work in a worker thread so the loop keeps serving; the loop waits
until that thread has launched the step's device work, so that the sends the last step woke run while the device
computes):
  1. admit waiting requests into free KV slots;
  2. ask each proposer, concurrently and under a deadline, for drafts of the decoding requests that use it
     (a missing or late draft means K = 0 for that row this step: slower, never wrong), as many tokens as the
     speculation planner expects to pay for their verification, and cut the drafts to the width it then picks;
  3. prefill prompt chunks (bounded by max_num_batched_tokens), then one target forward over every decoding row
     ([last committed token, x1..xK] each, at the row's own offset);
  4. verify all rows at once (rejection.py), roll every row back to its accepted length, emit the tokens.

This module holds the loop, admission and the requests' bookkeeping; each other job has its own module:
step_planning.py (each row's bound on K, prefill chunks), speculation_planner.py (how many of those draft
positions are worth verifying: adaptive speculation, over acceptance.py and step_cost.py), draft_collection.py
(asking the proposers, fallbacks and counts), step_execution.py (the tensor work on the compute thread),
request_stream.py (what callers iterate).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from concurrent.futures import Executor
from typing import Self

import torch

from services.common.drafter_methods import PREDICTION
from services.common.main_thread_compute import worker_thread
from services.common.proposer import Proposer, capabilities_known, capabilities_of
from services.modeling.hidden_layers import FINAL_ONLY
from services.modeling.host_copies import to_device
from services.modeling.runner import ModelRunner
from services.verifier import captured_verify, kv_scheduling
from services.verifier.draft_collection import DraftCollector
from services.verifier.engine_config import EngineConfig
from services.verifier.hidden_state_files import write_request_states
from services.verifier.runner_kept_states import kept_states_for
from services.verifier.outputs import FinishReason, RequestOutput, SpecDecodeCounts, TokenLogprob
from services.verifier.prediction_proposer import PredictionProposer
from services.verifier.random_streams import seed_to_int64
from services.verifier.request_state import OutputSink, RequestState
from services.verifier.request_stream import RequestStream
from services.verifier.sampling_params import GenerationRequest
from services.verifier.served_hidden_layers import served_hidden_layers
from services.verifier.spec_stats import PeriodicStatsLogger, SpecDecodeStats
from services.verifier.speculation_planner import SpeculationPlanner
from services.verifier.step_cost import StepCostModel, profile_step_cost
from services.verifier.step_execution import SampledRow, StepResult, execute_isolating_faults
from services.verifier.step_planning import PrefillBacklog, PrefillChunk, plan_prefill, speculation_cap
from services.verifier.structured_output import GrammarCompiler, OutputConstraintError, build_constraint

logger = logging.getLogger(__name__)

PROFILE_MAX_ROWS = 16  # the start-up cost profile's widest batch (larger ones are extrapolated, then observed)
PROFILE_MAX_WIDTH = 9  # ... and widest row: 1 + K for K = 8 (graphs are captured ahead at least this wide)
# How long the loop thread waits, at most, for a step's device work to be launched before it serves anything else
# (Engine.step says why); a bound, so that a busy compute thread never stalls the loop for longer.
LAUNCH_WAIT_S = 0.005


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later (maps to HTTP 503 / gRPC RESOURCE_EXHAUSTED, whose
    status says so: the message states only the facts, so a client's own advice is not repeated)."""


class RequestFailedError(RuntimeError):
    """The engine could not compute this request's next tokens (a server fault, gRPC INTERNAL); the requests that
    shared its step are not affected."""


class RequestConstraintError(ValueError):
    """The request's own constraints (grammar, token rules) allow no continuation (gRPC INVALID_ARGUMENT)."""


class RequestIdInUseError(ValueError):
    """A running or waiting request already has this id (gRPC ALREADY_EXISTS)."""


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        proposers: Mapping[str, Proposer] | None = None,
        eos_token_ids: Iterable[int] = (),
        compute: Executor | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """compute: the executor that runs every forward (see services/modeling/compute_placement.py); its owner
        shuts it down. Without one the engine keeps a worker thread of its own. grammars: compiles requests'
        structured_output for the target's tokenizer; without it such requests are refused."""
        self.grammars = grammars
        self.runner = runner
        self.config = config or EngineConfig()
        self.hidden_layers = served_hidden_layers((proposers or {}).values(), self.config.hidden_layers)
        if hasattr(runner, "serve_hidden_layers"):  # (again: an earlier engine on this runner may have set others)
            runner.serve_hidden_layers(self.hidden_layers)
        elif self.hidden_layers != FINAL_ONLY:
            raise ValueError(f"this runner serves only the final hidden states, not layers {list(self.hidden_layers)}")
        if hasattr(runner, "keep_hidden_states") and (self.config.extract_hidden_states_dir is not None or any(
                capabilities_of(p).needs_hidden_states for p in (proposers or {}).values())):
            runner.keep_hidden_states()  # so that requests that keep hidden states reuse cached prefixes too
        # OpenAI's predicted outputs draft in every engine, beside the proposers given (prediction_proposer.py)
        proposers = {PREDICTION: PredictionProposer(), **(proposers or {})}
        self.drafts = DraftCollector(
            proposers, runner.vocab_size, self.config.draft_timeout_s, self.config.max_draft_timeout_s
        )
        self.planner = SpeculationPlanner(StepCostModel.for_runner(runner), self.config.adaptive_speculation)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._stats_logger = PeriodicStatsLogger(self.config.log_stats_interval_s)
        # Output tokens committed, by the method that drafted them ("none": speculation off); with the accepted
        # draft tokens this gives the share of the output that drafts produced.
        self.generated_tokens: dict[str, int] = {}
        self.num_preemptions = 0  # requests whose KV blocks were taken back for others (kv_scheduling.py)
        self._states: dict[str, RequestState] = {}
        self._waiting: deque[RequestState] = deque()
        self._running: list[RequestState] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        # where a request without a seed gets one: reproducible under --seed (EngineConfig.seed)
        self._seed_source = random.SystemRandom() if self.config.seed is None else random.Random(self.config.seed)
        self._cost_profiled = False
        self._graphs_captured = False
        # One thread for all tensor work: torch's OpenMP pool belongs to the calling thread, so every step reuses
        # one pool instead of waking the pools of several default-executor threads.
        self._owns_executor = compute is None
        self._executor = compute if compute is not None else worker_thread()

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            await self._prepare()
            self._task = asyncio.create_task(self._run(), name="specserve-engine")

    async def _prepare(self) -> None:
        """Before the first step: capture the step graphs of short sequences (on an accelerator), so that no
        request waits on a capture the first time its batch has a shape, then profile what a verify costs."""
        if not self._graphs_captured:
            self._graphs_captured = True
            started = time.perf_counter()
            captured = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.runner.capture_graphs, self._widest_captured(),
                captured_verify.prototypes(trees=any(capabilities_of(p).sends_trees for p in self.proposers.values())))
            if captured:
                logger.info("captured %d step graphs in %.1f s", captured, time.perf_counter() - started)
        await self._profile_step_cost()

    def _widest_captured(self) -> int:
        """The widest row captured before the first step: 1 + K for K = 8 (PROFILE_MAX_WIDTH), or 1 + the most
        tokens a drafter declared it answers where that is more (a token tree of 24 nodes verifies 25 positions,
        whose graphs would otherwise be captured inside the first steps that verify one)."""
        return max(PROFILE_MAX_WIDTH, 1 + max(self._drafter_limits().values(), default=0))

    async def _profile_step_cost(self) -> None:
        """Time a few verify shapes once, before the first step (at start, or at the first step of an engine
        driven step by step), while the runner's slots are free."""
        if self._cost_profiled or not (self.config.adaptive_speculation and self.config.profile_step_cost):
            return
        self._cost_profiled = True
        rows = min(self.runner.max_num_seqs, PROFILE_MAX_ROWS)
        cache = self.config.step_cost_cache
        identity = cache.identity(rows, PROFILE_MAX_WIDTH) if cache else {}
        if cache and cache.load(identity, self.planner.cost):
            return
        await asyncio.get_running_loop().run_in_executor(
            self._executor, profile_step_cost, self.runner, self.planner.cost, rows, PROFILE_MAX_WIDTH,
        )
        if cache and self.planner.cost.fitted:
            cache.save(identity, self.planner.cost)

    async def shutdown(self) -> None:
        """Abort every request and stop after the step in flight (a forward is never cut in half)."""
        for request_id in list(self._states):
            self.abort(request_id)
        self._closing = True
        self._wakeup.set()
        await self.drafts.cancel_probes()
        if self._task is not None:
            await self._task
            self._task = None
        self._reap()
        if self._owns_executor:
            self._executor.shutdown(wait=True)
            self._executor = worker_thread()  # threads start lazily, so the engine can be started again

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def proposers(self) -> dict[str, Proposer]:
        """The proposers by method name (the draft collector's own dict: adding one here makes it usable)."""
        return self.drafts.proposers

    @property
    def stats_by_method(self) -> dict[str, SpecDecodeStats]:
        return self.drafts.stats_by_method

    @property
    def stats(self) -> SpecDecodeStats:
        """Engine-wide counts: the sum over proposers."""
        return self.drafts.stats

    def is_degraded(self, method: str) -> bool:
        """Whether `method`'s circuit breaker is open: its rows run at K = 0 unasked while it is probed."""
        breaker = self.drafts.breakers.get(method)
        return breaker is not None and breaker.is_open

    def readmit(self, method: str) -> None:
        """`method`'s drafter answered a health probe in time: ask it again from the next step (if its calls
        are still late, its breaker opens again after a few)."""
        self.drafts.readmit(method)

    def num_fallbacks(self, method: str) -> int:
        """Steps in which `method`'s proposal was late, failed or malformed (its rows ran with K = 0)."""
        return self.drafts.num_fallbacks(method)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest, outputs: OutputSink | None = None) -> RequestStream:
        """Queue a request; raises ValueError for an invalid one and EngineOverloadedError on a full queue.
        `outputs`: where its outputs (and a failure, as an exception) are put, as they come (None: a queue of its
        own, which the returned stream reads; with a sink, read them there and use the stream to abort)."""
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
            request=request, seed=seed, token_ids=list(request.prompt_token_ids),
            outputs=asyncio.Queue() if outputs is None else outputs,
            constraint=build_constraint(request.sampling, self.grammars, self.runner.vocab_size, self.eos_token_ids),
        )
        spec = request.speculation
        drafter = self.proposers.get(spec.method) if spec.enabled else None
        if self.config.extract_hidden_states_dir is not None or (
            drafter is not None and capabilities_of(drafter).needs_hidden_states
        ):
            # its drafter (EAGLE) reads the target's hidden states, or they are extracted
            state.hidden = kept_states_for(self.runner, request.request_id)
        if request.sampling.prompt_logprobs is not None:
            state.prompt_logprobs = []
        elif request.sampling.max_tokens == 0:  # nothing to generate or score: done without a slot or a forward
            self._finish(state, FinishReason.LENGTH, [], None)
            return RequestStream(state, self.abort)
        self._states[request.request_id] = state
        self._waiting.append(state)
        self._wakeup.set()
        return RequestStream(state, self.abort)

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

    @property
    def max_logprobs(self) -> int:
        """The most alternatives per position a request may ask (EngineConfig.max_logprobs; -1: the vocabulary)."""
        return self.runner.vocab_size if self.config.max_logprobs == -1 else self.config.max_logprobs

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
        if any(token >= vocab for token, _ in request.sampling.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if any(not 0 <= token < vocab for token in request.sampling.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(request.sampling, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs} (this server's --max-logprobs), "
                                 f"got {asked}")
        if any(not 0 <= token < vocab for token in request.sampling.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be in [0, {vocab})")
        if any(not 0 <= token < vocab for word in request.sampling.bad_words for token in word):
            raise ValueError(f"bad_words token ids must be in [0, {vocab})")
        spec = request.speculation
        if spec.prediction and spec.method != PREDICTION:
            raise ValueError(f"a prediction is drafted from by method {PREDICTION!r}, not {spec.method or 'none'!r}")
        if spec.method == PREDICTION and spec.num_speculative_tokens > 0 and not spec.prediction:
            raise ValueError(f"speculative method {PREDICTION!r} drafts from the request's predicted output, and it "
                             "has none (OpenAI's `prediction`: {\"type\": \"content\", \"content\": ...})")
        if any(not 0 <= token < vocab for token in spec.prediction):
            raise ValueError(f"prediction token ids must be in [0, {vocab})")
        if spec.enabled and spec.method not in self.proposers:
            available = ", ".join(sorted(self.proposers)) or "none configured"
            raise ValueError(f"unknown speculative method {spec.method!r}; available: {available}")
        if spec.draft_pipelining and not spec.enabled:
            raise ValueError("draft_pipelining needs speculation; this request has none")
        # a drafter not reached yet (None) is given the benefit of the doubt: its requests run at K = 0 meanwhile
        drafter = self.proposers[spec.method] if spec.draft_pipelining else None
        if drafter is not None and capabilities_known(drafter) and not capabilities_of(drafter).pre_drafts:
            raise ValueError(f"draft_pipelining: the {spec.method!r} drafter does not pre-draft (draft_model and "
                             "eagle do)")

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

    def _drafter_limits(self) -> dict[str | None, int]:
        """Each method's declared limit on K (0: none), read once a step: a proposer's capabilities may be a
        property built on each read (2.7 us for EAGLE's here), and every row's cap was read twice a step."""
        return {method: capabilities_of(drafter).max_speculative_tokens for method, drafter in self.proposers.items()}

    async def step(self) -> None:
        """One engine step over every running request."""
        await self._prepare()
        started = time.perf_counter()
        self._reap()
        self._admit()
        limits = self._drafter_limits()
        max_model_len = self.runner.max_model_len
        caps_by_id = {s.request_id: speculation_cap(s, max_model_len, limits) for s in self._running}  # once a step
        kv_scheduling.reserve_decode(
            self.runner, self._running, lambda s: len(s.token_ids) + caps_by_id[s.request_id], self._preempt
        )
        decode, prefilling = [], []
        for state in self._running:
            (prefilling if state.prefilling else decode).append(state)
        caps = [caps_by_id[s.request_id] for s in decode]
        backlog = PrefillBacklog.of(prefilling, self.config.max_num_batched_tokens)
        if not decode and not backlog.waiting:
            return
        asks = self.planner.draft_requests(decode, caps, backlog)
        drafting_started, fallbacks = time.perf_counter(), self.drafts.fallback_calls
        proposed = await self.drafts.collect(decode, asks)
        drafting_s = time.perf_counter() - drafting_started
        answered = self.drafts.fallback_calls == fallbacks  # no proposer was late or failed
        self.planner.observe_drafting(max(asks, default=0), drafting_s, answered)
        drafts = self.planner.choose_drafts(decode, proposed, backlog)
        # planned once the drafts are in hand: a row asked for drafts that has none leaves its room to the prompts
        decode_tokens = sum(1 + len(d.tokens) for d in drafts)
        prefill = plan_prefill(prefilling, decode_tokens, self.config.max_num_batched_tokens)
        loop = asyncio.get_running_loop()
        # The compute thread builds the step's inputs and launches its device work in Python, under the interpreter
        # lock. Handed the lock at once, the loop would spend it first on what the last step woke (every output's
        # send: tens of microseconds a request), and the device would wait for that. So the loop waits (lock
        # released) until the launch, and that work runs while the device computes.
        launched = threading.Event()
        running = loop.run_in_executor(
            self._executor, execute_isolating_faults, self.runner, prefill, decode, drafts, launched.set
        )
        launched.wait(LAUNCH_WAIT_S)
        result = await running
        if result.verify_timing is not None:
            self.planner.observe_forward(*result.verify_timing)
        failed = {state.request_id for state, _ in result.failures}
        for chunk in prefill:
            if chunk.state.request_id not in failed:
                chunk.state.num_computed += len(chunk.tokens)
        for state, states in result.prefill_hidden:
            if state.request_id not in failed and state.hidden is not None:
                state.hidden.append(states)
        self._record_prompt_scores(prefill, result, failed)
        for state, error in result.failures:
            self._fail(state, error)
        for row in result.rows:
            try:
                self._commit(row)
            except Exception as error:  # one row's bookkeeping fault fails that request only
                logger.exception("committing the output of request %s failed", row.state.request_id)
                self._fail(row.state, error)
        self._reap()
        step_s = time.perf_counter() - started
        if result.verify_timing is not None and not prefill:
            shape, forward_s = result.verify_timing
            self.planner.observe_overhead(step_s - forward_s - drafting_s, shape.width > 1, len(decode))
        self.planner.settle_probe(step_s, measured=not prefill)
        if self._stats_logger.due():
            self._stats_logger.maybe_log(self.stats)

    def _admit(self) -> None:
        """Waiting requests start, in order, while a sequence slot and the KV blocks of their prefill are free
        (kv_scheduling.py); a request resuming after a preemption keeps what it had."""
        while self._waiting and self.runner.num_free_slots() > 0:
            state = self._waiting[0]
            if not kv_scheduling.admit(self.runner, state, others_running=bool(self._running)):
                return
            self._waiting.popleft()
            self._running.append(state)
            if state.num_preemptions:
                continue
            if state.request.speculation.enabled:
                state.speculation = self.planner.start(state.request.speculation.method)
            if state.request.sampling.uses_penalties:
                vocab, device = self.runner.vocab_size, self.runner.device
                state.output_counts = torch.zeros(vocab, dtype=torch.float32, device=device)
                state.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
                state.prompt_mask[to_device(torch.tensor(state.request.prompt_token_ids), device)] = True

    def _preempt(self, state: RequestState) -> None:
        """Take the request's KV blocks back for the others; it waits at the head of the queue and recomputes."""
        kv_scheduling.release_for_recompute(self.runner, state)
        self._running.remove(state)
        self._waiting.appendleft(state)
        self.num_preemptions += 1

    def _reap(self) -> None:
        """Free the slots of finished (and aborted) requests; only called while no forward is in flight."""
        for state in [s for s in self._running if s.finished]:
            self._running.remove(state)
            self._extract(state)  # before its slot goes: the runner may hold states it has not read
            if state.has_slot:
                self.runner.remove_sequence(state.request_id)
                state.has_slot = False
            spec = state.request.speculation
            if spec.enabled:
                self.proposers[spec.method].release(state.request_id)
            self._states.pop(state.request_id, None)

    def _extract(self, state: RequestState) -> None:
        """extract_hidden_states: the finished request's token ids and states to its file (a write that fails
        is logged; serving goes on)."""
        folder = self.config.extract_hidden_states_dir
        if folder is None:  # (before reading the states: a read copies the rows a request kept uncopied)
            return
        states = state.hidden_states()
        if states is None:
            return
        try:
            write_request_states(folder, state.request_id, state.token_ids, state.num_prompt_tokens, states,
                                 self.hidden_layers)
        except OSError:
            logger.exception("could not write the hidden states of request %s to %s", state.request_id, folder)

    # -- bookkeeping (loop thread) --------------------------------------------------------------------------
    def _commit(self, row: SampledRow) -> None:
        state = row.state
        if row.hidden is not None and state.hidden is not None:
            state.hidden.append(row.hidden)
        if row.num_draft:
            state.num_computed = len(state.token_ids) + row.num_accepted
            state.spec.num_drafts += 1
            state.spec.num_draft_tokens += row.num_draft
            state.spec.num_accepted_tokens += row.num_accepted
            self.drafts.method_stats(state.request.speculation.method).record(row.num_draft, row.num_accepted)
            self.planner.observe_row(state, row.num_draft, row.num_accepted)
        elif not state.prefilling:  # the planner need not hear of a row that verified no draft (observe_row)
            state.num_computed = len(state.token_ids)
        if state.finished:  # aborted while the step ran
            return
        sampling = state.request.sampling
        emitted, reason, stop_token = [], None, None
        constraint = state.constraint
        token_ids, stop_ids = state.token_ids, sampling.stop_token_ids
        eos = () if sampling.ignore_eos else self.eos_token_ids
        # max_tokens or max_model_len, as a length of token_ids
        length_limit = min(state.output_end, self.runner.max_model_len)
        for token in row.tokens:
            emitted.append(token)
            token_ids.append(token)
            complete = constraint is not None and constraint.commit(token)  # the grammar allows nothing more
            if token in stop_ids or token in eos:
                reason, stop_token = FinishReason.STOP, token
            elif complete:
                reason = FinishReason.STOP
            elif len(token_ids) >= length_limit:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        method = state.request.speculation.method if state.speculative_tokens else "none"
        self.generated_tokens[method] = self.generated_tokens.get(method, 0) + len(emitted)
        if state.output_counts is not None:
            state.output_counts.index_add_(
                0,
                to_device(torch.tensor(emitted), state.output_counts.device),
                torch.ones(len(emitted), device=state.output_counts.device),
            )
        logprobs = row.logprobs[: len(emitted)] if row.logprobs is not None else None
        self._finish(state, reason, emitted, logprobs, stop_token)

    def _record_prompt_scores(self, prefill: list[PrefillChunk], result: StepResult, failed: set[str]) -> None:
        """Keep the step's prompt logprobs until the first output carries them; a request with max_tokens 0 is
        done once its prompt is in (it ends LENGTH with no token, its scores on that one output)."""
        for state, entries in result.prompt_scores:
            if state.request_id not in failed and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(entries)
        for chunk in prefill:
            state = chunk.state
            scored_only = chunk.final and state.request.sampling.max_tokens == 0
            if scored_only and state.request_id not in failed and not state.finished:
                self._finish(state, FinishReason.LENGTH, [], None)

    def _fail(self, state: RequestState, error: Exception) -> None:
        """End one request with an error (its stream raises it); the other requests of the step go on."""
        if not state.finished:
            state.finish_reason = FinishReason.ABORT
            if isinstance(error, OutputConstraintError):
                failure: Exception = RequestConstraintError(f"request {state.request_id}: {error}")
            else:
                failure = RequestFailedError(f"request {state.request_id} failed in the engine: {error!r}")
            state.outputs.put_nowait(failure)

    def _finish(
        self,
        state: RequestState,
        reason: FinishReason | None,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        stop_token: int | None = None,
    ) -> None:
        """Publish one output; with a reason, the request is done (its slot is freed by _reap). The first output
        after the prefill carries the prompt logprobs, when asked (an abort during the prefill has none).
        stop_token: the stop or end-of-sequence token the request ended on."""
        state.finish_reason = reason
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.prefilling:
            prompt_logprobs, state.prompt_logprobs = tuple(state.prompt_logprobs), None
        state.outputs.put_nowait(
            RequestOutput(
                request_id=state.request_id,
                token_ids=tuple(tokens),
                logprobs=None if logprobs is None else tuple(logprobs),
                finish_reason=reason,
                num_prompt_tokens=state.num_prompt_tokens,
                num_output_tokens=state.num_output_tokens,
                num_cached_tokens=state.num_cached_tokens,
                spec=SpecDecodeCounts(
                    state.spec.num_drafts, state.spec.num_draft_tokens, state.spec.num_accepted_tokens
                ),
                prompt_logprobs=prompt_logprobs,
                stop_token_id=stop_token,
            )
        )
