"""Greedy output is the same with prefix caching on and off, with and without speculation, across block
boundaries, after preemption and recompute in a pool too small for every request at once, and the same as
transformers' own `generate`; cached tokens are reported per request."""

from __future__ import annotations

import random

import pytest
import torch

from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.paged_kv_cache import PagedKVCache
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import repetitive_prompt
from tests.proposers import RandomProposer
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2

MAX_MODEL_LEN = 160
BLOCK = 4


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_llama(seed=3) if request.param == "llama" else tiny_qwen2(seed=4)


def engine_for(model, prefix: bool, max_num_seqs: int = 6, pool_tokens: int | None = None) -> Engine:
    memory = None
    if pool_tokens is not None:
        config = model.config
        per_token = PagedKVCache.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                                                 config.hidden_size // config.num_attention_heads, torch.float32)
        memory = pool_tokens * per_token
    runner = LlamaFamilyRunner(model, max_num_seqs, MAX_MODEL_LEN, kv_cache=KVCacheConfig(memory, BLOCK, prefix))
    proposers = {"ngram": NgramProposer(NgramSettings(1, 3)), "random": RandomProposer(VOCAB, seed=2)}
    return Engine(runner, EngineConfig(max_num_batched_tokens=32, log_stats_interval_s=0, adaptive_speculation=False),
                  proposers, eos_token_ids=())


def conversation_schedule(rng: random.Random, method: str | None):
    """A shared 30-token system prompt, then turns that quote the conversation so far: later requests start
    with what earlier ones computed (prefix hits), at lengths that cross block boundaries anywhere."""
    system = repetitive_prompt(rng, 30)
    arrivals = {}
    for i in range(8):
        prompt = system + repetitive_prompt(rng, rng.randint(1, 25))
        if i >= 4:  # a second turn: an earlier prompt plus more
            prompt = arrivals[(i - 4) * 2][0].prompt_token_ids + repetitive_prompt(rng, rng.randint(1, 9))
        spec = SpeculationParams(method, 1 + i % 5) if method else SpeculationParams()
        request = GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(8, 30), temperature=0.0),
                                    spec)
        arrivals[i * 2] = [request]
    return arrivals


@pytest.mark.parametrize("method", [None, "ngram", "random"])
async def test_greedy_output_is_the_same_with_prefix_caching_on_and_off(model, method):
    baseline = await run_schedule(engine_for(model, prefix=False), conversation_schedule(random.Random(5), None))
    engine = engine_for(model, prefix=True)
    cached = await run_schedule(engine, conversation_schedule(random.Random(5), method))
    for request_id, result in baseline.items():
        assert cached[request_id].tokens == result.tokens, request_id
    reported = [cached[f"r{i}"].outputs[-1].num_cached_tokens for i in range(8)]
    assert reported[0] == 0 and all(n > 0 and n % BLOCK == 0 for n in reported[1:]), reported
    assert engine.runner.kv_usage.prefix_cache.hits == sum(reported)
    assert all(result.outputs[-1].num_cached_tokens == 0 for result in baseline.values())


@pytest.mark.parametrize("method", [None, "ngram"])
async def test_a_full_pool_preempts_and_recomputes_without_changing_the_output(model, method):
    """Eight requests of up to ~80 tokens each in a pool of 200 tokens: some are preempted mid-decode, give their
    blocks back, wait and recompute; every output is what an uncrowded engine gives."""
    rng = random.Random(9)
    prompts = [repetitive_prompt(rng, rng.randint(20, 50)) for _ in range(8)]
    spec = SpeculationParams(method, 4) if method else SpeculationParams()
    requests = [GenerationRequest(f"p{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0), spec)
                for i, prompt in enumerate(prompts)]
    roomy = await run_schedule(engine_for(model, prefix=False, max_num_seqs=8), {0: requests})
    for prefix in (False, True):
        crowded_engine = engine_for(model, prefix=prefix, max_num_seqs=8, pool_tokens=200)
        crowded = await run_schedule(crowded_engine, {0: requests})
        assert crowded_engine.num_preemptions > 0
        for request_id, result in roomy.items():
            assert crowded[request_id].tokens == result.tokens and len(result.tokens) == 30, (prefix, request_id)
        assert crowded_engine.runner.kv_usage.used_blocks == 0


async def test_greedy_output_with_cache_hits_equals_transformers_generate(model):
    rng = random.Random(3)
    prompt = repetitive_prompt(rng, 37)
    engine = engine_for(model, prefix=True)
    requests = [GenerationRequest(f"g{i}", prompt, SamplingParams(max_tokens=20, temperature=0.0),
                                  SpeculationParams("ngram", 3)) for i in range(3)]
    results = await run_schedule(engine, {0: requests[:1], 3: requests[1:]})
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert [results[f"g{i}"].tokens for i in range(3)] == [expected] * 3
    assert [results[f"g{i}"].outputs[-1].num_cached_tokens for i in range(3)] == [0, 36, 36]
