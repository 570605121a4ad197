"""Greedy output is token-identical with speculation on and off, whatever the drafter proposes.

Batches mix prompt lengths, K from 1 to 8, several drafters at once, and requests that join and leave mid-way.
"""

from __future__ import annotations

import random

import pytest

from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import random_workload, repetitive_prompt
from tests.proposers import OracleProposer, RandomProposer
from tests.step_costs import FixedCost
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2


def make_engine(model, proposers, max_num_seqs=4, max_num_batched_tokens=24, adaptive=False) -> Engine:
    """Adaptive K stays off unless asked, so that every K in 1..8 is really exercised."""
    runner = LlamaFamilyRunner(model, max_num_seqs=max_num_seqs, max_model_len=160)
    config = EngineConfig(
        max_num_batched_tokens=max_num_batched_tokens, log_stats_interval_s=0, adaptive_speculation=adaptive
    )
    return Engine(runner, config, proposers, eos_token_ids=())


async def greedy_baseline(model, prompts, max_tokens):
    """The schedule run without speculation: the greedy output every speculative run of it must equal."""
    return await run_schedule(make_engine(model, {}), build_schedule([SpeculationParams()] * len(prompts), prompts,
                                                                     max_tokens))


def build_schedule(specs, prompts, max_tokens):
    """Requests arrive two per step at staggered times; short and long ones interleave so slots are reused."""
    arrivals: dict[int, list[GenerationRequest]] = {}
    for i, (prompt, spec) in enumerate(zip(prompts, specs, strict=True)):
        request = GenerationRequest(
            f"r{i}", prompt, SamplingParams(max_tokens=max_tokens[i], temperature=0.0), spec
        )
        arrivals.setdefault((i // 2) * 3, []).append(request)
    return arrivals


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_llama(seed=3) if request.param == "llama" else tiny_qwen2(seed=4)


async def test_greedy_equality_across_drafters_and_k(model):
    n = 10
    prompts, max_tokens = random_workload(7, n, (3, 40), (5, 40))

    baseline_engine = make_engine(model, {})
    baseline = await run_schedule(
        baseline_engine, build_schedule([SpeculationParams()] * n, prompts, max_tokens)
    )
    references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(n)}
    for i in range(n):
        assert len(baseline[f"r{i}"].tokens) == max_tokens[i]

    proposers = {
        "ngram": NgramProposer(NgramSettings(1, 3)),
        "random": RandomProposer(VOCAB, seed=1),
        "oracle": OracleProposer(references),
    }
    methods = ["ngram", "random", "oracle"]
    for k in range(1, 9):
        specs = [SpeculationParams(methods[(i + k) % 3], k if i % 4 else 1 + (k % 3)) for i in range(n)]
        engine = make_engine(model, proposers)
        speculative = await run_schedule(engine, build_schedule(specs, prompts, max_tokens))
        for i in range(n):
            assert speculative[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"K={k} request r{i} ({specs[i]})"
        oracle_rows = [speculative[f"r{i}"] for i in range(n) if specs[i].method == "oracle"]
        for row in oracle_rows:  # a perfect drafter is accepted in full
            spec = row.outputs[-1].spec
            assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
        random_rows = [speculative[f"r{i}"] for i in range(n) if specs[i].method == "random"]
        assert sum(r.outputs[-1].spec.num_draft_tokens for r in random_rows) > 0
        assert engine.stats.num_drafts > 0


async def test_alone_equals_batched_with_requests_leaving(model):
    """A request's greedy output does not depend on who else is in the batch or when they leave."""
    rng = random.Random(11)
    prompts = [repetitive_prompt(rng, rng.randint(5, 30)) for _ in range(5)]
    alone = []
    for i, prompt in enumerate(prompts):
        engine = make_engine(model, {"ngram": NgramProposer()})
        request = GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0.0))
        alone.append((await run_schedule(engine, {0: [request]}))[f"r{i}"].tokens)
    engine = make_engine(model, {"ngram": NgramProposer()}, max_num_seqs=3)
    requests = [
        GenerationRequest(
            f"r{i}",
            prompt,
            SamplingParams(max_tokens=20 if i != 1 else 3, temperature=0.0),
            SpeculationParams("ngram", 4),
        )
        for i, prompt in enumerate(prompts)
    ]
    together = await run_schedule(engine, {0: requests[:3], 2: requests[3:]})
    for i in range(5):
        expected = alone[i] if i != 1 else alone[1][:3]
        assert together[f"r{i}"].tokens == expected


async def test_stop_tokens_max_tokens_and_eos_with_speculation():
    model = tiny_llama(seed=5)
    rng = random.Random(3)
    prompt = repetitive_prompt(rng, 20)
    engine = make_engine(model, {})
    plain = (await run_schedule(engine, {0: [GenerationRequest("a", prompt, SamplingParams(max_tokens=30, temperature=0))]}))["a"].tokens
    stop_at = plain[12]
    first = plain.index(stop_at)
    references = {"b": prompt + tuple(plain), "c": prompt + tuple(plain)}
    engine = Engine(
        LlamaFamilyRunner(model, 4, 160),
        EngineConfig(log_stats_interval_s=0),
        {"oracle": OracleProposer(references)},
        eos_token_ids=(),
    )
    results = await run_schedule(
        engine,
        {
            0: [
                GenerationRequest("b", prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop_at,)),
                                  SpeculationParams("oracle", 8)),
                GenerationRequest("c", prompt, SamplingParams(max_tokens=7, temperature=0), SpeculationParams("oracle", 8)),
            ]
        },
    )
    assert results["b"].tokens == plain[: first + 1] and results["b"].finish_reason == "stop"
    assert results["c"].tokens == plain[:7] and results["c"].finish_reason == "length"
    # eos ends a request unless ignore_eos
    engine = Engine(LlamaFamilyRunner(model, 4, 160), EngineConfig(log_stats_interval_s=0), {}, eos_token_ids=(stop_at,))
    results = await run_schedule(
        engine,
        {0: [GenerationRequest("d", prompt, SamplingParams(max_tokens=30, temperature=0)),
             GenerationRequest("e", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))]},
    )
    assert results["d"].tokens == plain[: first + 1] and results["d"].finish_reason == "stop"
    assert results["e"].tokens == plain and results["e"].finish_reason == "length"


async def test_generation_stops_at_max_model_len():
    model = tiny_llama(seed=5)
    runner = LlamaFamilyRunner(model, 2, 24)
    engine = Engine(runner, EngineConfig(log_stats_interval_s=0), {"ngram": NgramProposer()})
    prompt = tuple(range(1, 21))
    results = await run_schedule(
        engine,
        {0: [GenerationRequest("a", prompt, SamplingParams(max_tokens=100, temperature=0), SpeculationParams("ngram", 8))]},
    )
    assert len(prompt) + len(results["a"].tokens) == 24
    assert results["a"].finish_reason == "length"


async def test_greedy_with_penalties_matches_without_speculation():
    """Penalties at each verified position must see the drafts before it; otherwise outputs diverge."""
    model = tiny_llama(seed=8)
    rng = random.Random(5)
    prompts = [repetitive_prompt(rng, 25) for _ in range(3)]
    sampling = SamplingParams(
        max_tokens=30, temperature=0, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3
    )

    async def run(spec: SpeculationParams, proposers):
        engine = make_engine(model, proposers)
        requests = [GenerationRequest(f"r{i}", p, sampling, spec) for i, p in enumerate(prompts)]
        return await run_schedule(engine, {0: requests})

    baseline = await run(SpeculationParams(), {})
    references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(3)}
    oracle = await run(SpeculationParams("oracle", 6), {"oracle": OracleProposer(references)})
    ngram = await run(SpeculationParams("ngram", 5), {"ngram": NgramProposer()})
    for i in range(3):
        assert oracle[f"r{i}"].tokens == baseline[f"r{i}"].tokens
        assert ngram[f"r{i}"].tokens == baseline[f"r{i}"].tokens
        spec = oracle[f"r{i}"].outputs[-1].spec
        assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    unpenalised = await run_schedule(
        make_engine(model, {}),
        {0: [GenerationRequest("x", prompts[0], SamplingParams(max_tokens=30, temperature=0))]},
    )
    assert unpenalised["x"].tokens != baseline["r0"].tokens  # the penalties really act


async def test_adaptive_k_shrinks_for_rejected_drafts_and_keeps_output(model):
    rng = random.Random(13)
    prompts = [repetitive_prompt(rng, 20) for _ in range(3)]
    requests = lambda spec: [
        GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0), spec) for i, p in enumerate(prompts)
    ]
    baseline = await run_schedule(make_engine(model, {}), {0: requests(SpeculationParams())})
    fixed = make_engine(model, {"random": RandomProposer(VOCAB, seed=2)})
    adaptive = make_engine(model, {"random": RandomProposer(VOCAB, seed=2)}, adaptive=True)
    adaptive.planner.cost = FixedCost()  # a CPU's cost shape, not a tiny model's near-flat one
    fixed_out = await run_schedule(fixed, {0: requests(SpeculationParams("random", 8))})
    adaptive_out = await run_schedule(adaptive, {0: requests(SpeculationParams("random", 8))})
    for i in range(3):
        assert fixed_out[f"r{i}"].tokens == adaptive_out[f"r{i}"].tokens == baseline[f"r{i}"].tokens
    # random drafts are rejected, so the adaptive engine drafts far fewer tokens per draft
    assert adaptive.stats.num_draft_tokens / adaptive.stats.num_drafts < 3
    assert fixed.stats.num_draft_tokens / fixed.stats.num_drafts > 6
