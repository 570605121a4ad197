"""Prompt logprobs (SamplingParams.prompt_logprobs) and max_tokens 0 in the engine.

The reference is transformers' own forward over the whole prompt: log_softmax(model(ids).logits). The engine
must agree at every prompt position whatever the prefill chunking, the runner, the batch around the request and
speculation; rows that did not ask must emit exactly what they emit without a scoring request beside them.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.modeling.generic_runner import GenericRunner
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine, RequestFailedError
from services.verifier.engine_config import EngineConfig
from services.verifier.outputs import FinishReason
from services.verifier.prompt_scoring import SCORING_BLOCK, score_positions
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import repetitive_prompt
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2

TOP = 5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny_llama(seed=5) if request.param == "llama" else tiny_qwen2(seed=6)


def engine_for(model, runner="llama", chunk=16, proposers=None, max_num_seqs=4) -> Engine:
    runner_cls = LlamaFamilyRunner if runner == "llama" else GenericRunner
    return Engine(
        runner_cls(model, max_num_seqs=max_num_seqs, max_model_len=256),
        EngineConfig(max_num_batched_tokens=chunk, log_stats_interval_s=0, adaptive_speculation=False),
        proposers or {},
    )


def reference_logprobs(model, prompt) -> torch.Tensor:
    """[P, V] log-softmax of transformers' own logits over the whole prompt, position j predicting token j+1."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_reference(model, prompt, entries, num_top=TOP):
    reference = reference_logprobs(model, prompt)
    assert [e.token_id for e in entries] == list(prompt[1:])
    for j, entry in enumerate(entries):
        expected = reference[j]
        assert entry.logprob == pytest.approx(expected[prompt[j + 1]].item(), abs=1e-4), f"position {j + 1}"
        assert entry.rank == int((expected >= expected[prompt[j + 1]]).sum())
        top_lp, top_ids = expected.topk(num_top)
        assert [t for t, _ in entry.top] == top_ids.tolist(), f"position {j + 1}"
        assert [lp for _, lp in entry.top] == pytest.approx(top_lp.tolist(), abs=1e-4)
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)


def prompt_of(seed: int, length: int) -> tuple[int, ...]:
    return repetitive_prompt(random.Random(seed), length)


def prompt_logprobs_of(result) -> list:
    carrying = [o for o in result.outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is result.outputs[0], "prompt logprobs travel on the first output only"
    return list(carrying[0].prompt_logprobs)


@pytest.mark.parametrize("runner", ["llama", "generic"])
@pytest.mark.parametrize("chunk", [7, 512])
async def test_prompt_logprobs_equal_transformers_log_softmax_at_every_position(model, runner, chunk):
    prompt = prompt_of(1, 45)
    sampling = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP)
    result = await run_schedule(engine_for(model, runner, chunk), {0: [GenerationRequest("s", prompt, sampling)]})
    assert_matches_reference(model, prompt, prompt_logprobs_of(result["s"]))
    assert len(result["s"].tokens) == 4


async def test_scoring_beside_other_rows_changes_nobody_s_output(model):
    """Plain rows (greedy and sampled, speculating and not) emit the same tokens with a scoring request in their
    batch; the scoring request's own generated tokens equal those it generates without scoring."""
    ngram = {"ngram": NgramProposer(NgramSettings(1, 3))}
    others = [
        GenerationRequest("greedy", prompt_of(2, 30), SamplingParams(max_tokens=12, temperature=0.0)),
        GenerationRequest("sampled", prompt_of(3, 20), SamplingParams(max_tokens=12, temperature=0.9, seed=4)),
        GenerationRequest("spec", prompt_of(4, 25), SamplingParams(max_tokens=12, temperature=0.0),
                          SpeculationParams("ngram", 3)),
    ]
    prompt = prompt_of(5, 40)
    scoring = GenerationRequest("score", prompt, SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=3),
                                SpeculationParams("ngram", 4))
    plain = GenerationRequest("score", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    alone = await run_schedule(engine_for(model, proposers=ngram), {0: others, 1: [plain]})
    together = await run_schedule(engine_for(model, proposers=ngram), {0: others, 1: [scoring]})
    for rid in ("greedy", "sampled", "spec", "score"):
        assert together[rid].tokens == alone[rid].tokens, rid
    assert together["spec"].outputs[-1].spec.num_draft_tokens > 0
    assert_matches_reference(model, prompt, prompt_logprobs_of(together["score"]), num_top=3)
    assert all(o.prompt_logprobs is None for rid in ("greedy", "sampled", "spec") for o in together[rid].outputs)


async def test_max_tokens_0_scores_the_prompt_and_generates_nothing(model):
    prompt = prompt_of(6, 33)
    engine = engine_for(model, chunk=10)
    scored = GenerationRequest("scored", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    bare = GenerationRequest("bare", prompt, SamplingParams(max_tokens=0))
    result = await run_schedule(engine, {0: [scored, bare]})
    assert result["scored"].tokens == [] and result["scored"].finish_reason == FinishReason.LENGTH
    assert len(result["scored"].outputs) == 1
    entries = prompt_logprobs_of(result["scored"])
    assert len(entries) == len(prompt) - 1 and all(e.top == () for e in entries)
    assert_matches_reference(model, prompt, entries, num_top=0)
    assert result["bare"].tokens == [] and result["bare"].finish_reason == FinishReason.LENGTH
    assert result["bare"].outputs[0].prompt_logprobs is None and result["bare"].outputs[0].num_prompt_tokens == 33
    assert engine.runner.num_free_slots() == 4


async def test_max_tokens_0_without_scoring_takes_no_slot_and_no_step(model):
    engine = engine_for(model)
    stream = engine.add_request(GenerationRequest("x", prompt_of(7, 12), SamplingParams(max_tokens=0)))
    (output,) = stream.ready_outputs()
    assert output.finish_reason == FinishReason.LENGTH and output.token_ids == ()
    assert engine.num_waiting == 0 and engine.num_running == 0


async def test_a_one_token_prompt_has_no_prompt_logprobs(model):
    request = GenerationRequest("one", (7,), SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    result = await run_schedule(engine_for(model), {0: [request]})
    assert prompt_logprobs_of(result["one"]) == [] and len(result["one"].tokens) == 2


async def test_a_failing_row_keeps_its_fault_and_scoring_rows_keep_their_scores(model):
    """A row that makes the batched step fail (a seed admission would have refused) fails alone; the step
    re-runs row by row and the scoring requests beside it still get complete, correct prompt logprobs."""
    prompts = {"s1": prompt_of(8, 20), "s2": prompt_of(9, 12), "plain": prompt_of(10, 15)}
    sampling = {"s1": SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2),
                "s2": SamplingParams(max_tokens=3, temperature=0.7, prompt_logprobs=2),
                "plain": SamplingParams(max_tokens=3, temperature=0.7)}
    engine = engine_for(model, chunk=64)
    streams = {rid: engine.add_request(GenerationRequest(rid, prompts[rid], sampling[rid])) for rid in prompts}
    engine._states["s2"].seed = 2**70  # overflows the step's int64 seed tensor: the batched step raises
    outputs, errors = {rid: [] for rid in prompts}, {}
    for _ in range(50):
        await engine.step()
        for rid, stream in streams.items():
            try:
                outputs[rid] += stream.ready_outputs()
            except RequestFailedError as error:
                errors[rid] = error
        if engine.num_running == 0 and engine.num_waiting == 0:
            break
    assert set(errors) == {"s2"}
    entries = [e for o in outputs["s1"] for e in (o.prompt_logprobs or ())]
    assert_matches_reference(model, prompts["s1"], entries, num_top=2)
    assert sum(len(o.token_ids) for o in outputs["plain"]) == 3


def test_score_positions_blocks_agree_with_one_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(SCORING_BLOCK * 2 + 5, VOCAB) * 4
    tokens = torch.randint(0, VOCAB, (logits.shape[0] - 1,)).tolist()
    entries = score_positions(logits, tokens, num_top=20)
    reference = torch.log_softmax(logits, dim=-1)
    for j, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(reference[j, tokens[j]].item(), abs=1e-5)
        assert entry.rank == int((reference[j] > reference[j, tokens[j]]).sum()) + 1
        if entry.rank == 1:  # the argmax reports exactly the top logprob (lm-eval's greedy check uses ==)
            assert entry.top[0] == (tokens[j], entry.logprob)
        assert all(math.isfinite(lp) for _, lp in entry.top) and len(entry.top) == 20


def test_prompt_logprobs_are_validated_at_admission():
    """The upper bound is the server's --max-logprobs, checked by the engine (test_engine_lifecycle)."""
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    assert SamplingParams(max_tokens=0, prompt_logprobs=20).prompt_logprobs == 20
