"""The EAGLE heads that ship for SmolLM2-135M-Instruct, on the real target: their files load and fit it, the
verifier serves the layers each reads, greedy output equals no speculation, and their drafts are accepted (a head
wired to the wrong layers or vocabulary would draft noise, which stays lossless but accepts next to nothing)."""

from __future__ import annotations

import pytest

from services.common.speculative_config import SpeculativeConfig
from services.drafter.methods.eagle import build_proposer
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.unit.test_real_model import PROMPTS, chat_ids

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
async def test_a_shipped_head_keeps_greedy_output_and_gets_drafts_accepted(smollm2, method):
    tokenizer = smollm2.tokenizer
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS[1:3]]
    proposer = build_proposer(SpeculativeConfig.model_validate({"method": method, "num_speculative_tokens": 4}))
    runner = LlamaFamilyRunner(smollm2.model, max_num_seqs=2, max_model_len=512)
    config = EngineConfig(max_num_batched_tokens=256, log_stats_interval_s=0, adaptive_speculation=False)

    def requests(speculation: SpeculationParams) -> dict[int, list[GenerationRequest]]:
        return {0: [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=32, temperature=0.0), speculation)
                    for i, p in enumerate(prompts)]}

    plain = await run_schedule(Engine(runner, config, {}, [tokenizer.eos_token_id]), requests(SpeculationParams()))
    engine = Engine(runner, config, {method: proposer}, [tokenizer.eos_token_id])
    drafted = await run_schedule(engine, requests(SpeculationParams(method, 4)))
    for rid in plain:
        assert drafted[rid].tokens == plain[rid].tokens, rid
    stats = engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens / stats.num_draft_tokens > 0.1
