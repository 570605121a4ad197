"""End to end through the engine: sampled output with speculation follows the target model's distribution.

A tiny model with a 12-token vocabulary makes the exact joint distribution of the first two output tokens cheap
to compute with transformers' own forward, so thousands of seeded requests can be compared with it by
chi-square (significance ALPHA, fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.drafter.methods.ngram import NgramProposer
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.proposers import ModelSamplingProposer, RandomProposer
from tests.schedules import RandomSchedulePlanner
from tests.stats import ALPHA, chi_square_p_value, reference_processed, total_variation
from tests.tiny_models import tiny_llama

V = 12
PROMPT = (1, 5, 2, 7, 1, 5)
SAMPLES = 3000


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=21, vocab_size=V)


def exact_joint(model, params: SamplingParams) -> np.ndarray:
    """p(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2): the engine samples t1 at prefill and drafts
    from t2 on, so the second and third tokens are the ones speculation produces."""
    with torch.inference_mode():
        p1 = reference_processed(model(input_ids=torch.tensor([PROMPT])).logits[0, -1].numpy(), params)
        one = model(input_ids=torch.tensor([PROMPT + (a,) for a in range(V)])).logits[:, -1].numpy()
        two = model(input_ids=torch.tensor([PROMPT + (a, b) for a in range(V) for b in range(V)])).logits[:, -1]
        two = two.numpy().reshape(V, V, V)
    joint = np.zeros((V, V))
    for a in range(V):
        p2 = reference_processed(one[a], params)
        for b in range(V):
            joint[b] += p1[a] * p2[b] * reference_processed(two[a, b], params)
    return joint


async def sample_pairs(model, params, spec, proposers, planner=None, kv_cache=None, samples=SAMPLES,
                       max_tokens=4) -> np.ndarray:
    """With `planner`, the engine verifies the draft positions it chooses (tests.schedules.RandomSchedulePlanner:
    any cut, 0 included); without, every row verifies its whole draft (adaptive speculation off: whether drafting
    pays for a tiny model depends on the machine's timings, and these tests must verify drafts)."""
    engine = Engine(
        LlamaFamilyRunner(model, max_num_seqs=500, max_model_len=16, kv_cache=kv_cache),
        EngineConfig(max_num_batched_tokens=4096, max_waiting_requests=samples, log_stats_interval_s=0,
                     adaptive_speculation=planner is not None),
        proposers,
    )
    if planner is not None:
        engine.planner = planner
    requests = [
        GenerationRequest(f"s{i}", PROMPT, SamplingParams(**{**params.__dict__, "seed": 1000 + i, "max_tokens": max_tokens}), spec)
        for i in range(samples)
    ]
    results = await run_schedule(engine, {0: requests})
    joint = np.zeros((V, V))
    for result in results.values():
        joint[result.tokens[1], result.tokens[2]] += 1
    return joint, engine


CASES = {
    "t1.0_same_model_q_sent": (SamplingParams(temperature=1.0), "same", True),
    "t0.7_top_k_other_model_q_sent": (SamplingParams(temperature=0.7, top_k=5), "other", True),
    "t1.0_top_p_other_model_no_q": (SamplingParams(temperature=1.0, top_p=0.85), "other", False),
    "t0.7_random_drafts": (SamplingParams(temperature=0.7), "random", False),
}
# In this case the prompts come from the prefix cache: with blocks of 2 tokens, every request after the first
# wave finds 4 of its 6 prompt tokens cached, and its drafts are verified over K/V earlier requests computed.
PREFIX_CACHE_CASE = "t1.0_top_p_other_model_no_q"


@pytest.mark.parametrize("case", CASES)
async def test_engine_samples_follow_the_target(target, case):
    params, drafter, send_q = CASES[case]
    if drafter == "random":
        proposer = RandomProposer(V, seed=3)
    else:
        draft_model = target if drafter == "same" else tiny_llama(seed=99, vocab_size=V)
        proposer = ModelSamplingProposer(draft_model, params.temperature, send_q, seed=5, method="sampler")
    kv_cache = KVCacheConfig(block_size=2) if case == PREFIX_CACHE_CASE else None
    joint, engine = await sample_pairs(target, params, SpeculationParams(proposer.method, 2),
                                       {proposer.method: proposer}, kv_cache=kv_cache)
    stats = engine.stats
    hits = engine.runner.kv_usage.prefix_cache.hits
    assert hits >= 4 * (SAMPLES - 500) if case == PREFIX_CACHE_CASE else hits == 0
    assert stats.num_drafts > 0
    expected = exact_joint(target, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
    if drafter == "same":
        assert stats.acceptance_rate > 0.6  # a high-acceptance drafter really was accepted
    if drafter == "random":
        assert stats.acceptance_rate < 0.3


async def test_samples_follow_the_target_whatever_positions_each_step_verifies(target):
    """K drawn at random per row and step (0 included): the schedule never shows in the distribution."""
    params = SamplingParams(temperature=0.8)
    proposer = ModelSamplingProposer(tiny_llama(seed=99, vocab_size=V), 0.8, True, seed=7, method="sampler")
    planner = RandomSchedulePlanner(seed=11)
    joint, engine = await sample_pairs(target, params, SpeculationParams("sampler", 2), {"sampler": proposer}, planner)
    stats = engine.stats
    assert planner.lengths_used == {0, 1, 2} and stats.num_drafts > 0
    expected = exact_joint(target, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)


async def test_engine_negative_control(target):
    """The statistic rejects samples drawn at a different temperature than the one it is checked against."""
    joint, _ = await sample_pairs(target, SamplingParams(temperature=1.0), SpeculationParams(), {})
    assert chi_square_p_value(joint, exact_joint(target, SamplingParams(temperature=0.7))) < ALPHA


async def test_seeded_sampling_is_identical_with_speculation_on_and_off(target):
    """Noise is keyed by (seed, position): a deterministic drafter cannot change a seeded request's tokens,
    even with penalties and top-p, and a seeded request does not depend on its batch neighbours."""
    model = tiny_llama(seed=6)
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, presence_penalty=0.3, seed=1234)
    prompt = (3, 4, 5, 3, 4, 5, 6, 3, 4)

    async def run(spec, neighbours: int):
        # every draft verified (no adaptive speculation): which steps the planner asks for drafts depends on timings
        config = EngineConfig(log_stats_interval_s=0, adaptive_speculation=False)
        engine = Engine(LlamaFamilyRunner(model, 8, 96), config, {"ngram": NgramProposer()})
        requests = [GenerationRequest("main", prompt, params, spec)] + [
            GenerationRequest(f"n{i}", prompt[i:], SamplingParams(max_tokens=10 + i, temperature=1.0), spec)
            for i in range(neighbours)
        ]
        return (await run_schedule(engine, {0: requests}))["main"]

    plain = await run(SpeculationParams(), 0)
    for k in (1, 3, 6):
        speculative = await run(SpeculationParams("ngram", k), 4)
        assert speculative.tokens == plain.tokens
        assert speculative.outputs[-1].spec.num_draft_tokens > 0
    other_seed = await run_schedule(
        Engine(LlamaFamilyRunner(model, 1, 96), EngineConfig(log_stats_interval_s=0)),
        {0: [GenerationRequest("x", prompt, SamplingParams(**{**params.__dict__, "seed": 99}))]},
    )
    assert other_seed["x"].tokens != plain.tokens
