"""Adaptive speculation in the engine: output never depends on the schedule, poor drafts in a batch fall to
K = 0 (with re-probes), good ones keep their K, and costs are profiled at start and learned while serving."""

from __future__ import annotations

import random

from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import repetitive_prompt
from tests.proposers import EmptyProposer, OracleProposer, RandomProposer
from tests.schedules import RandomSchedulePlanner
from tests.step_costs import FixedCost
from tests.tiny_models import VOCAB, tiny_llama


def engine_with(model, proposers, cost=None, max_num_seqs=8, adaptive=True) -> Engine:
    runner = LlamaFamilyRunner(model, max_num_seqs=max_num_seqs, max_model_len=160)
    config = EngineConfig(log_stats_interval_s=0, adaptive_speculation=adaptive, profile_step_cost=cost is None)
    engine = Engine(runner, config, proposers)
    if cost is not None:
        engine.planner.cost = cost
    return engine


def greedy(rid, prompt, spec=None, max_tokens=30):
    spec = spec or SpeculationParams()
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec)


async def baseline_for(model, prompts, max_tokens=30):
    out = await run_schedule(engine_with(model, {}), {0: [greedy(f"r{i}", p, max_tokens=max_tokens)
                                                         for i, p in enumerate(prompts)]})
    return {rid: c.tokens for rid, c in out.items()}


async def test_greedy_output_is_the_same_whatever_positions_each_step_verifies():
    model = tiny_llama(seed=3)
    rng = random.Random(5)
    prompts = [repetitive_prompt(rng, rng.randint(5, 40)) for _ in range(6)]
    baseline = await baseline_for(model, prompts)
    references = {rid: prompts[int(rid[1:])] + tuple(tokens) for rid, tokens in baseline.items()}
    proposers = {"ngram": NgramProposer(NgramSettings(1, 3)), "oracle": OracleProposer(references),
                 "random": RandomProposer(VOCAB, seed=4)}
    methods = list(proposers)
    engine = engine_with(model, proposers)
    engine.planner = RandomSchedulePlanner(seed=9)
    requests = [greedy(f"r{i}", p, SpeculationParams(methods[i % 3], 6)) for i, p in enumerate(prompts)]
    out = await run_schedule(engine, {0: requests})
    assert {rid: c.tokens for rid, c in out.items()} == baseline
    assert engine.planner.lengths_used == set(range(7))


async def test_poor_drafts_in_a_batch_run_at_k0_with_rare_probes_and_the_same_output():
    model = tiny_llama(seed=3)
    rng = random.Random(6)
    prompts = [repetitive_prompt(rng, 20) for _ in range(8)]
    baseline = await baseline_for(model, prompts, max_tokens=60)
    engine = engine_with(model, {"random": RandomProposer(VOCAB, seed=2)}, cost=FixedCost())
    out = await run_schedule(engine, {0: [greedy(f"r{i}", p, SpeculationParams("random", 8), 60)
                                          for i, p in enumerate(prompts)]})
    assert {rid: c.tokens for rid, c in out.items()} == baseline
    stats = engine.stats
    row_steps = 8 * 59  # every row decodes 59 steps after its prefill
    assert 0 < stats.num_drafts < row_steps / 4  # re-probed now and then, mostly K = 0
    assert stats.num_draft_tokens < 2 * stats.num_drafts  # probes verify one position


async def test_a_drafter_that_has_nothing_is_rarely_asked_where_columns_cost_nothing_or_something():
    """Every ask is a drafting call (a gRPC round trip, a large share of an accelerator's step). Once its drafter
    has been seen to have nothing, a request is asked only by its probes, and a probe that comes back empty backs
    off as a rejected one does: it used to stay due and ask every step (98 calls in 99 steps, with either cost)."""
    model = tiny_llama(seed=3)
    rng = random.Random(6)
    prompt = repetitive_prompt(rng, 20)
    baseline = await baseline_for(model, [prompt], max_tokens=100)
    accelerator_like = FixedCost(base=0.0034, per_row=0.0, per_token=0.0)  # a wider step costs nothing more
    for cost in (FixedCost(), accelerator_like):
        proposer = EmptyProposer()
        engine = engine_with(model, {"empty": proposer}, cost=cost)
        out = await run_schedule(engine, {0: [greedy("r0", prompt, SpeculationParams("empty", 4), 100)]})
        assert out["r0"].tokens == baseline["r0"]
        # 99 decode steps: the first asks (until its measured rate of drafts falls: 8-16 calls, with the timings),
        # then probes 8, 16, 32 and 64 steps apart
        assert proposer.calls < 30, proposer.calls


async def test_good_drafts_keep_their_k_alone_and_in_a_batch():
    model = tiny_llama(seed=3)
    rng = random.Random(7)
    prompts = [repetitive_prompt(rng, 20) for _ in range(8)]
    baseline = await baseline_for(model, prompts, max_tokens=60)
    references = {rid: prompts[int(rid[1:])] + tuple(tokens) for rid, tokens in baseline.items()}
    for batch in (prompts[:1], prompts):
        engine = engine_with(model, {"oracle": OracleProposer(references)}, cost=FixedCost())
        out = await run_schedule(engine, {0: [greedy(f"r{i}", p, SpeculationParams("oracle", 8), 60)
                                              for i, p in enumerate(batch)]})
        assert all(c.tokens == baseline[rid] for rid, c in out.items())
        stats = engine.stats
        assert stats.num_draft_tokens / stats.num_drafts > 6  # near the full K = 8 (the tail has less room)


async def test_alone_one_request_drafts_even_at_modest_acceptance_and_in_a_batch_it_does_not():
    """The same ngram drafts are worth verifying for one request (a column costs ~5% of its step) and not for
    sixteen (a column costs each row ~1 ms of a ~50 ms step)."""
    model = tiny_llama(seed=3)
    rng = random.Random(8)
    prompts = [repetitive_prompt(rng, 30) for _ in range(16)]
    per_step = {}
    for size in (1, 16):
        engine = engine_with(model, {"random": RandomProposer(VOCAB, seed=1)}, cost=FixedCost(), max_num_seqs=16)
        await run_schedule(engine, {0: [greedy(f"r{i}", p, SpeculationParams("random", 4), 40)
                                        for i, p in enumerate(prompts[:size])]})
        per_step[size] = engine.stats.num_draft_tokens / (size * 39)
    assert per_step[1] > 3 * per_step[16]


async def test_the_engine_profiles_verify_costs_at_start_and_keeps_learning():
    model = tiny_llama(seed=3)
    rng = random.Random(9)
    engine = engine_with(model, {"ngram": NgramProposer()})
    async with engine:
        assert engine.planner.cost.fitted  # profiled before serving
        assert engine.runner.num_free_slots() == engine.runner.max_num_seqs  # its slots given back
        profiled = engine.planner.cost.num_observations
        streams = [engine.add_request(greedy(f"r{i}", repetitive_prompt(rng, 20), SpeculationParams("ngram", 4)))
                   for i in range(3)]
        for stream in streams:
            async for _ in stream:
                pass
        assert engine.planner.cost.num_observations > profiled


async def test_without_adaptation_every_row_verifies_its_full_draft():
    model = tiny_llama(seed=3)
    rng = random.Random(10)
    prompts = [repetitive_prompt(rng, 20) for _ in range(4)]
    engine = engine_with(model, {"random": RandomProposer(VOCAB, seed=2)}, cost=FixedCost(), adaptive=False)
    await run_schedule(engine, {0: [greedy(f"r{i}", p, SpeculationParams("random", 5), 60)
                                    for i, p in enumerate(prompts)]})
    assert engine.stats.num_accepted_tokens < 0.1 * engine.stats.num_draft_tokens  # rejected, and yet
    assert engine.stats.num_draft_tokens > 4.5 * engine.stats.num_drafts  # full K (less only at the tail)
