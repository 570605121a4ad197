"""The verifier's engine metrics, read through a real registry after real engine steps: KV slot use while
requests run, output tokens and per-position drafts per method, and late proposals told apart from failures (a
drafter too slow is a scaling signal; one that is down is not)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
from prometheus_client import CollectorRegistry

from services.common.proposer import Draft, DraftInput
from services.drafter.methods.ngram import NgramProposer
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.draft_breaker import OPEN_AFTER
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.metrics import EngineCollector
from services.verifier.remote_proposer import DrafterLateError
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.proposers import FailingProposer
from tests.tiny_models import tiny_llama

MODEL = "tiny"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPT = (3, 4, 5, 3, 4, 5, 6, 7, 3, 4)


class LateRemoteProposer:
    """Answers like a remote drafter whose own step deadline passed (RemoteProposer raises DrafterLateError)."""

    method = "late-remote"

    def __init__(self) -> None:
        self.calls = 0

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        self.calls += 1
        raise DrafterLateError("drafter at x:1 did not answer within 0.045s")

    def release(self, seq_id: Hashable) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=2)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": MODEL, **labels})


def request(request_id: str, method: str | None) -> GenerationRequest:
    return GenerationRequest(request_id, PROMPT, GREEDY, SpeculationParams(method, 4 if method else 0))


def engine_with(model, proposers) -> tuple[Engine, CollectorRegistry]:
    engine = Engine(
        LlamaFamilyRunner(model, max_num_seqs=8, max_model_len=64, kv_cache=KVCacheConfig(block_size=4)),
        EngineConfig(draft_timeout_s=0.05, log_stats_interval_s=0, adaptive_speculation=False),
        proposers,
    )
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, MODEL, lambda: [*proposers, "idle"]))
    return engine, registry


async def test_kv_block_use_and_prefix_cache_counters_follow_the_requests(model):
    engine, registry = engine_with(model, {"ngram": NgramProposer()})
    block_size = engine.runner.kv_usage.block_size
    total = sample(registry, "specserve_kv_cache_blocks_total")
    assert total == engine.runner.kv_usage.total_blocks > 0 and sample(registry, "specserve_kv_cache_blocks_used") == 0
    engine.add_request(request("a", "ngram"))
    engine.add_request(request("b", None))
    engine.add_request(request("c", None))
    await engine.step()  # admitted and prefilled: they hold their prompts' blocks until they finish
    assert sample(registry, "specserve_num_requests_running") == 3
    used = sample(registry, "specserve_kv_cache_blocks_used")
    assert used == 3 * -(-len(PROMPT) // block_size)  # admitted together: nothing was cached yet
    assert sample(registry, "specserve_kv_cache_usage_perc") == used / total
    assert sample(registry, "specserve_prefix_cache_queries_total") == 3 * len(PROMPT)
    while engine.num_running:
        await engine.step()
    assert sample(registry, "specserve_kv_cache_blocks_used") == sample(registry, "specserve_kv_cache_usage_perc") == 0
    assert sample(registry, "specserve_kv_cache_blocks_cached") >= len(PROMPT) // block_size
    engine.add_request(request("d", None))  # the same prompt again: its full blocks but the last come from the cache
    await engine.step()
    assert sample(registry, "specserve_prefix_cache_hits_total") == (len(PROMPT) - 1) // block_size * block_size
    assert sample(registry, "specserve_num_preemptions_total") == 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total"):  # vLLM's names, the same values
        assert sample(registry, f"vllm:{name}") == sample(registry, f"specserve_{name}"), name
    assert sample(registry, "vllm:num_requests_running") == 1


async def test_tokens_positions_and_late_proposals_per_method(model):
    hanging, broken, late_remote = FailingProposer("slow", "hang"), FailingProposer("down", "raise"), LateRemoteProposer()
    engine, registry = engine_with(
        model, {"ngram": NgramProposer(), "slow": hanging, "down": broken, "late-remote": late_remote}
    )
    requests = [request("a", "ngram"), request("b", "slow"), request("c", "down"), request("d", None),
                request("e", "late-remote")]
    results = await run_schedule(engine, {0: requests})
    for method, request_id in (("ngram", "a"), ("slow", "b"), ("down", "c"), ("none", "d"), ("late-remote", "e")):
        generated = sample(registry, "specserve_generation_tokens_total", method=method)
        assert generated == len(results[request_id].tokens) == GREEDY.max_tokens, method
    assert sample(registry, "specserve_generation_tokens_total", method="idle") == 0

    late = "specserve_spec_decode_num_late_proposals_total"
    fallbacks = "specserve_spec_decode_num_fallbacks_total"
    # each failing drafter: OPEN_AFTER calls late (or failed), then its breaker opens and the rest of its steps
    # ran at K = 0 unasked; every one is a fallback
    breakers = engine.drafts.breakers
    assert sample(registry, late, method="slow") == OPEN_AFTER <= hanging.calls
    assert sample(registry, fallbacks, method="slow") == OPEN_AFTER + breakers["slow"].skipped_steps
    assert sample(registry, late, method="late-remote") == OPEN_AFTER <= late_remote.calls
    assert sample(registry, late, method="down") == 0 < OPEN_AFTER <= broken.calls
    assert sample(registry, fallbacks, method="down") == OPEN_AFTER + breakers["down"].skipped_steps
    for method in ("slow", "down", "late-remote"):
        assert sample(registry, "specserve_drafter_degraded", method=method) == 1, method
        assert sample(registry, "specserve_drafter_degraded_episodes_total", method=method) == 1, method
    assert sample(registry, "specserve_drafter_degraded", method="ngram") == 0
    assert sample(registry, late, method="ngram") == 0 and sample(registry, late, method="idle") == 0

    stats = engine.stats_by_method["ngram"]
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert sample(registry, "specserve_generation_tokens_total", method="ngram") > stats.num_accepted_tokens
    for position, (drafted, accepted) in enumerate(zip(stats.drafts_per_position, stats.accepted_per_position,
                                                       strict=True)):
        labels = {"method": "ngram", "position": str(position)}
        assert sample(registry, "specserve_spec_decode_num_drafts_per_pos_total", **labels) == drafted
        assert sample(registry, "specserve_spec_decode_num_accepted_tokens_per_pos_total", **labels) == accepted
    assert sample(registry, "specserve_spec_decode_num_drafts_per_pos_total", method="ngram",
                  position="0") == stats.num_drafts
    # vLLM's names: one series per model, summed over the drafters (only ngram accepted anything here)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sample(registry, f"vllm:spec_decode_{name}_total") == sum(
            getattr(s, name) for s in engine.stats_by_method.values()), name
    for position, accepted in enumerate(stats.accepted_per_position):
        per_pos = sample(registry, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
        assert per_pos == accepted
