"""The per-proposer circuit breaker: opens after OPEN_AFTER consecutive late or failed calls, then its rows run at
K = 0 without a call (so without a deadline wait) while background probes, backing off, check the proposer; a
probe in time closes it. Output never changes, whatever the breaker does."""

from __future__ import annotations

import asyncio
import time

from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.draft_breaker import FIRST_BACKOFF_S, MAX_BACKOFF_S, OPEN_AFTER, DraftBreaker
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.proposers import OracleProposer
from tests.tiny_models import tiny_llama

DEADLINE_S = 0.05


def test_it_opens_after_consecutive_misses_only():
    breaker = DraftBreaker("m")
    for _ in range(OPEN_AFTER - 1):
        breaker.missed(0.0, "late")
    breaker.answered(0.0)  # an answer in time resets the count
    for _ in range(OPEN_AFTER - 1):
        breaker.missed(1.0, "late")
    assert not breaker.is_open
    breaker.missed(1.0, "late")
    assert breaker.is_open and breaker.num_openings == 1


def test_probes_back_off_while_they_fail_and_one_in_time_closes_it():
    breaker = DraftBreaker("m")
    for _ in range(OPEN_AFTER):
        breaker.missed(10.0, "late")
    assert not breaker.probe_due(10.0)
    assert breaker.probe_due(10.0 + FIRST_BACKOFF_S)
    assert not breaker.probe_due(11.0)  # one probe in flight at a time
    now, waits = 11.0, []
    for _ in range(6):
        breaker.probe_failed(now)
        wait = breaker.next_probe_at - now
        waits.append(wait)
        assert not breaker.probe_due(now + wait - 1e-3) and breaker.probe_due(now + wait)
        now += wait
    assert waits == sorted(waits) and waits[0] == 2 * FIRST_BACKOFF_S and waits[-1] == MAX_BACKOFF_S
    breaker.answered(now)
    assert not breaker.is_open and not breaker.probe_due(now + 100)


class PausableProposer:
    """Proposes the target's own greedy continuation, or, while paused, hangs until resumed (SIGSTOP-like)."""

    method = "pausable"

    def __init__(self, references) -> None:
        self.oracle = OracleProposer(references)
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.calls = 0

    async def propose(self, inputs):
        self.calls += 1
        await self.resumed.wait()
        return await self.oracle.propose(inputs)

    def release(self, seq_id) -> None:
        pass


def greedy(rid, prompt, max_tokens, spec):
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec)


async def test_a_hung_proposer_stops_costing_deadlines_and_is_readmitted_when_it_answers():
    model = tiny_llama(seed=2)
    prompt = (3, 4, 5, 3, 4, 5, 6, 7, 3, 4)

    def engine(proposers):
        runner = LlamaFamilyRunner(model, max_num_seqs=2, max_model_len=160)
        config = EngineConfig(draft_timeout_s=DEADLINE_S, log_stats_interval_s=0, adaptive_speculation=False)
        return Engine(runner, config, proposers)

    baseline = await run_schedule(engine({}), {0: [greedy("r", prompt, 60, SpeculationParams())]})
    reference = {rid: prompt + tuple(baseline["r"].tokens) for rid in ("hung", "back")}
    drafter = PausableProposer(reference)
    spec = SpeculationParams("pausable", 4)
    hung_engine = engine({"pausable": drafter})

    drafter.resumed.clear()
    started = time.perf_counter()
    hung = await run_schedule(hung_engine, {0: [greedy("hung", prompt, 60, spec)]})
    elapsed = time.perf_counter() - started
    assert hung["hung"].tokens == baseline["r"].tokens
    breaker = hung_engine.drafts.breakers["pausable"]
    assert breaker.is_open and hung_engine.is_degraded("pausable")
    late = hung_engine.stats_by_method["pausable"].num_late_proposals
    # the steps waited for OPEN_AFTER deadlines, then not again (probes run beside the steps, never in them)
    assert late == OPEN_AFTER
    # every decode step that asked for a draft ran at K = 0: the late ones, then the ones not asked
    assert hung_engine.num_fallbacks("pausable") == OPEN_AFTER + breaker.skipped_steps > 50
    assert drafter.calls < 50 and elapsed >= OPEN_AFTER * DEADLINE_S

    drafter.resumed.set()
    breaker.next_probe_at = 0.0  # the backoff has passed
    # the drafter answers at once now; a loaded machine must not make its probe miss the short deadline the hung
    # phase above needs (2 test workers on 2 cores: it missed 50 ms once, and the breaker stayed open)
    deadline = hung_engine.drafts.deadline("pausable")
    deadline.floor_s = deadline.cap_s = 1.0
    back = await run_schedule(hung_engine, {0: [greedy("back", prompt, 60, spec)]})
    assert back["back"].tokens == baseline["r"].tokens
    assert not hung_engine.is_degraded("pausable")
    assert hung_engine.stats_by_method["pausable"].num_accepted_tokens > 0
    await hung_engine.shutdown()


async def test_a_probe_still_in_flight_at_shutdown_is_cancelled():
    drafter = PausableProposer({})
    drafter.resumed.clear()
    runner = LlamaFamilyRunner(tiny_llama(seed=2), max_num_seqs=2, max_model_len=160)
    engine = Engine(runner, EngineConfig(draft_timeout_s=10.0, log_stats_interval_s=0), {"pausable": drafter})
    breaker = engine.drafts.breaker("pausable")
    for _ in range(OPEN_AFTER):
        breaker.missed(0.0, "late")
    breaker.next_probe_at = 0.0
    await run_schedule(engine, {0: [greedy("x", (3, 4, 5), 4, SpeculationParams("pausable", 2))]})
    (probe,) = engine.drafts._probes  # it hangs with the drafter (under a 10 s deadline)
    await engine.shutdown()
    assert probe.cancelled() and not engine.drafts._probes
