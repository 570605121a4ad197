"""The batch-invariant runner (batch_invariance.py): in bf16 a token's logits are the same bits whatever its forward
carries, so speculative greedy output equals non-speculative output token for token; without the mode they are
not (the negative control)."""

from __future__ import annotations

import pytest
import torch

from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.modeling.batch_invariance import InvariantShape, waves
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.runner import RowInput
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.proposers import OracleProposer, RandomProposer
from tests.tiny_models import smollm2_shaped

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_bf16():
    from services.modeling.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16")


def runner_for(model: torch.nn.Module, batch_invariant: bool) -> LlamaFamilyRunner:
    """Three sequences, the most any test here runs at once: the invariant shape is then 3 rows of 8 tokens, each
    wave a quarter cheaper than 4 rows (bf16 on a CPU without bf16 instructions is slow: an AVX2-only EPYC took
    0.9 s a wave of 4 rows). 192 positions hold the longest request here (133 prompt tokens, 16 generated, 9
    drafts); every wave reads them all, so a longer context costs every wave."""
    return LlamaFamilyRunner(model, max_num_seqs=3, max_model_len=192, batch_invariant=batch_invariant,
                             kv_cache=KVCacheConfig(memory_bytes=64 << 20, block_size=16))


def test_waves_feed_each_row_in_order_within_the_fixed_shape():
    shape = InvariantShape(rows=2, width=3, span=64)
    assert waves([1, 7, 2], shape) == [[(0, 0, 1), (1, 0, 3)], [(1, 3, 6), (2, 0, 2)], [(1, 6, 7)]]
    assert InvariantShape.for_runner(64, 8000, 16) == InvariantShape(8, 8, 8000)
    assert InvariantShape.for_runner(2, 100, 16).as_tuple == (2, 8, 112)


def first_logits(loaded, batch_invariant: bool, batched: bool) -> torch.Tensor:
    """The same token at the same position: decoded alone, or as the first of 5 fed tokens beside two other rows."""
    runner = runner_for(loaded.model, batch_invariant)
    for seq, n in (("a", 62), ("b", 63), ("c", 64)):  # prompts that share their start: b and c hit a's blocks
        prompt = list(range(3, n))
        cached = runner.add_sequence(seq, prompt)
        assert cached == (0 if seq == "a" else 48)  # whole blocks of 16
        runner.forward([RowInput(seq, prompt[cached:], 1)])
    if batched:
        rows = [RowInput("a", [5, 6, 7, 8, 9], 5), RowInput("b", [1, 2, 3], 3), RowInput("c", [4], 1)]
    else:
        rows = [RowInput("a", [5], 1)]
    return runner.forward(rows).logits[0, 0]


@pytest.fixture(scope="module")
def logits_of(smollm2_bf16):
    """first_logits by (batch_invariant, batched), each computed once for this module's tests."""
    computed: dict[tuple[bool, bool], torch.Tensor] = {}

    def get(batch_invariant: bool, batched: bool) -> torch.Tensor:
        if (batch_invariant, batched) not in computed:
            computed[batch_invariant, batched] = first_logits(smollm2_bf16, batch_invariant, batched)
        return computed[batch_invariant, batched]

    return get


def test_in_bf16_a_tokens_logits_do_not_depend_on_what_else_its_forward_carries(logits_of):
    assert torch.equal(logits_of(True, False), logits_of(True, True))


def test_the_mode_changes_rounding_alone(logits_of):
    """The invariant forward computes the plain forward's logits up to bf16 rounding, and so does the plain forward
    of a batch. Where the CPU's bf16 matmuls add in an order that depends on the shape, the plain bits differ with the
    batch (0.56 in a logit on a Xeon with AMX, measured), which is what the mode is for; on a CPU without bf16
    instructions (an AMD EPYC with AVX2 alone) torch's kernels gave the same bits for every batch tried, so the
    difference is not asserted, only bounded."""
    plain_alone = logits_of(False, False)
    assert (logits_of(False, True) - plain_alone).abs().max() < 2.0
    assert (logits_of(True, False) - plain_alone).abs().max() < 2.0
    assert plain_alone.abs().max() > 5.0  # logits of a real model, not zeros


def shaped_prompts(vocab_size: int) -> list[tuple[int, ...]]:
    """Three prompts as long as test_real_model.py's first three chat prompts in SmolLM2's tokens (133, 45 and 37),
    each a seeded random span that then repeats in part, as a code edit repeats its source: n-gram drafts find
    matches in them."""
    generator = torch.Generator().manual_seed(0)
    prompts = []
    for length in (133, 45, 37):
        span = torch.randint(3, vocab_size, (length // 2,), generator=generator).tolist()
        prompts.append(tuple((span + span)[:length]))
    return prompts


async def test_in_bf16_speculative_greedy_output_is_the_non_speculative_one_token_for_token():
    """On random weights in SmolLM2-135M's layer shapes (tests/tiny_models.py: smollm2_shaped): the same matmul
    shapes as the real model, so the same kernels and orders of addition, at a twentieth of its cost (5 s against
    106 s on this 2-core AVX2-only EPYC, where a decode wave of the real model costs about a second). The oracle's
    drafts are the baseline's own tokens, so every one of them is accepted: rows of 10 positions whose every logit
    must match the single-token decode's."""
    model = smollm2_shaped().to(torch.bfloat16)
    vocab_size = model.config.vocab_size
    prompts = shaped_prompts(vocab_size)
    runner = runner_for(model, batch_invariant=True)
    assert not runner.supports_trees  # the engine feeds trees' first paths to it

    async def run(spec: SpeculationParams, references: dict[str, tuple[int, ...]]):
        proposers = {"ngram": NgramProposer(NgramSettings(1, 3)), "random": RandomProposer(vocab_size, seed=0),
                     "oracle": OracleProposer(references)}
        engine = Engine(runner, EngineConfig(max_num_batched_tokens=48, log_stats_interval_s=0,
                                             adaptive_speculation=False), proposers, [])
        requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                                      spec) for i, p in enumerate(prompts)]
        return await run_schedule(engine, {0: requests[:2], 2: requests[2:]})

    baseline = await run(SpeculationParams(), {})
    assert sum(len(c.tokens) for c in baseline.values()) == 48
    references = {request_id: prompts[int(request_id[1:])] + tuple(c.tokens) for request_id, c in baseline.items()}
    accepted = {}
    for spec in (SpeculationParams("ngram", 4), SpeculationParams("random", 3), SpeculationParams("ngram", 9),
                 SpeculationParams("oracle", 9)):
        result = await run(spec, references)
        for request_id, collected in baseline.items():
            assert result[request_id].tokens == collected.tokens, (spec, request_id)
        accepted[spec.method] = accepted.get(spec.method, 0) + sum(
            c.outputs[-1].spec.num_accepted_tokens for c in result.values())  # counts since each request began
    assert accepted["oracle"] >= 3 * 9  # each request verified at least one whole row of 9 drafts and kept it
    assert accepted["ngram"] > 0  # the prompts' repeats gave n-gram drafts that were kept
