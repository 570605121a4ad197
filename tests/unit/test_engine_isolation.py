"""One request never harms another inside the engine: values that admission must normalise (64-bit seeds, tiny
temperatures, logprobs of filtered tokens, top-n beyond the vocabulary), a row that makes the batched step fail
anyway (only that request fails; the others emit exactly what an undisturbed run emits), and a drafter outage
logged once when it starts and once when it ends."""

from __future__ import annotations

import logging
import math

import pytest

from services.common.proposer import Draft
from services.common.sampling_rules import LOGPROB_FLOOR
from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.draft_breaker import OPEN_AFTER
from services.verifier.engine import Engine, RequestFailedError
from services.verifier.engine_config import EngineConfig
from services.verifier.random_streams import seed_to_int64
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.proposers import FailingProposer
from tests.tiny_models import tiny_llama

PROMPTS = {
    "a": (3, 4, 5, 3, 4, 5, 6, 7, 3, 4),
    "b": (9, 8, 7, 6, 9, 8, 7),
    "c": (11, 12, 13, 11, 12, 13, 11, 12, 13, 14, 15),
    "d": (20, 21, 22, 23),
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=2)


def engine_for(model, proposers=None, max_num_seqs=4) -> Engine:
    return Engine(
        LlamaFamilyRunner(model, max_num_seqs=max_num_seqs, max_model_len=96),
        EngineConfig(draft_timeout_s=0.5, log_stats_interval_s=0),
        proposers or {},
    )


def requests(sampling: SamplingParams, speculation: SpeculationParams | None = None) -> list[GenerationRequest]:
    speculation = speculation or SpeculationParams()
    return [GenerationRequest(rid, prompt, sampling, speculation) for rid, prompt in PROMPTS.items()]


@pytest.mark.parametrize("seed", [2**63 - 1, 2**63, 2**64 - 1, -(2**63), -1, 0])
def test_seeds_of_the_whole_64_bit_range_keep_their_bit_pattern(seed):
    value = seed_to_int64(seed)
    assert -(2**63) <= value < 2**63
    assert value % 2**64 == seed % 2**64  # a bijection on 64-bit patterns: distinct seeds, distinct streams


async def test_unsigned_64_bit_seeds_sample_reproducibly_beside_other_requests(model):
    """The defect: a seed >= 2**63 overflowed the step's int64 seed tensor and failed every request in it."""
    big = SamplingParams(max_tokens=10, temperature=1.0, seed=2**64 - 1)
    mixed = [
        GenerationRequest("big", PROMPTS["a"], big),
        GenerationRequest("big+1", PROMPTS["a"], SamplingParams(max_tokens=10, temperature=1.0, seed=2**63)),
        GenerationRequest("plain", PROMPTS["b"], SamplingParams(max_tokens=10, temperature=0.0)),
    ]
    together = await run_schedule(engine_for(model), {0: mixed})
    alone = await run_schedule(engine_for(model), {0: [GenerationRequest("big", PROMPTS["a"], big)]})
    assert all(len(r.tokens) == 10 for r in together.values())
    assert together["big"].tokens == alone["big"].tokens
    assert together["big"].tokens != together["big+1"].tokens


async def test_the_engines_seed_makes_requests_without_one_reproducible(model):
    """vLLM's --seed (EngineConfig.seed): a fresh engine sent the same unseeded requests in the same order samples the
    same tokens, another seed other tokens; without one, each request draws fresh randomness."""
    unseeded = SamplingParams(max_tokens=12, temperature=1.0)

    async def sampled(seed):
        engine = Engine(LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=96),
                        EngineConfig(log_stats_interval_s=0, seed=seed), {})
        return {rid: r.tokens for rid, r in (await run_schedule(engine, {0: requests(unseeded)})).items()}

    first, again, other = await sampled(7), await sampled(7), await sampled(8)
    assert first == again and first != other
    assert await sampled(None) != await sampled(None)


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**64, 1.5])
def test_seeds_outside_the_64_bit_range_are_refused_at_admission(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": math.inf},
        {"temperature": math.nan},
        {"repetition_penalty": math.inf},
        {"stop_token_ids": tuple(range(100_000))},  # every emitted token is checked against them on the shared loop
        {"stop_token_ids": (-1,)},
    ],
)
def test_non_finite_values_are_refused_at_admission(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


async def test_a_vanishing_temperature_samples_greedily_with_finite_logprobs(model):
    """temperature 1e-45 divided the logits into infinities: NaN logprobs, or empty text."""
    greedy = await run_schedule(engine_for(model), {0: requests(SamplingParams(max_tokens=8, temperature=0.0))})
    tiny = await run_schedule(
        engine_for(model), {0: requests(SamplingParams(max_tokens=8, temperature=1e-45, seed=5, logprobs=2))}
    )
    for rid in PROMPTS:
        assert tiny[rid].tokens == greedy[rid].tokens
        entries = [e for o in tiny[rid].outputs for e in o.logprobs]
        assert entries and all(math.isfinite(e.logprob) for e in entries)


async def test_logprobs_of_filtered_tokens_are_a_finite_floor(model):
    """top-k/top-p remove tokens; their -inf logprob (an alternative in the top-n list) cannot travel as JSON."""
    sampling = SamplingParams(max_tokens=8, temperature=0.8, top_k=2, top_p=0.5, seed=3, logprobs=5)
    result = await run_schedule(engine_for(model), {0: requests(sampling)})
    values = [v for r in result.values() for o in r.outputs for e in o.logprobs for v in (e.logprob, *(x for _, x in e.top))]
    assert values and all(math.isfinite(v) and v >= LOGPROB_FLOOR for v in values)
    assert LOGPROB_FLOOR in values  # the filtered alternatives are reported, at the floor


async def test_more_logprobs_than_the_vocabulary_has(model):
    small_vocab = tiny_llama(seed=3, vocab_size=12)
    result = await run_schedule(
        engine_for(small_vocab), {0: [GenerationRequest("x", (1, 2, 3), SamplingParams(max_tokens=4, logprobs=20))]}
    )
    entries = [e for o in result["x"].outputs for e in o.logprobs]
    assert len(entries) == 4 and all(len(e.top) == 12 for e in entries)


async def _run_collecting_errors(engine: Engine, batch: list[GenerationRequest], poison: str | None):
    """Run `batch` to completion; `poison` names a request given, behind admission's back, a seed that overflows
    the step's int64 seed tensor (the original defect), so the batched step raises."""
    streams = {r.request_id: engine.add_request(r) for r in batch}
    if poison is not None:
        engine._states[poison].seed = 2**70
    tokens = {rid: [] for rid in streams}
    errors = {}
    for _ in range(200):
        await engine.step()
        for rid, stream in streams.items():
            try:
                for output in stream.ready_outputs():
                    tokens[rid] += output.token_ids
            except RequestFailedError as error:
                errors[rid] = error
        if engine.num_running == 0 and engine.num_waiting == 0:
            return tokens, errors
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("speculation", [SpeculationParams(), SpeculationParams("ngram", 3)], ids=["off", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_a_poisoned_row_fails_alone_and_the_others_are_undisturbed(model, speculation, temperature):
    sampling = SamplingParams(max_tokens=12, temperature=temperature, seed=7)
    batch = requests(sampling, speculation)
    ngram = {"ngram": NgramProposer(NgramSettings(1, 3))}
    clean, clean_errors = await _run_collecting_errors(engine_for(model, ngram), requests(sampling, speculation), None)
    engine = engine_for(model, ngram)
    tokens, errors = await _run_collecting_errors(engine, batch, poison="c")
    assert not clean_errors
    assert set(errors) == {"c"} and "failed in the engine" in str(errors["c"])
    for rid in ("a", "b", "d"):
        assert tokens[rid] == clean[rid] and len(tokens[rid]) == 12
    assert engine.runner.num_free_slots() == 4  # the failed request's slot is free again


async def test_a_drafter_outage_is_logged_once_when_it_starts_and_once_when_it_ends(model, caplog):
    failing = FailingProposer("remote", "raise")
    engine = engine_for(model, {"remote": failing})
    spec = SpeculationParams("remote", 3)
    caplog.set_level(logging.INFO, logger="services.verifier.engine")
    await run_schedule(engine, {0: [GenerationRequest("x", PROMPTS["a"], SamplingParams(max_tokens=10, temperature=0), spec)]})
    assert failing.calls == OPEN_AFTER  # then its breaker opens: not asked again until a probe is due
    assert engine.num_fallbacks("remote") > failing.calls  # every decode step ran at K = 0

    async def propose(inputs):  # the drafter is back (with nothing to propose)
        return [Draft(()) for _ in inputs]

    failing.propose = propose
    engine.drafts.breakers["remote"].next_probe_at = 0.0  # the backoff has passed
    await run_schedule(engine, {0: [GenerationRequest("y", PROMPTS["b"], SamplingParams(max_tokens=4, temperature=0), spec)]})
    lines = [r.getMessage() for r in caplog.records if "'remote'" in r.getMessage()]
    assert len(lines) == 4, lines
    assert "unavailable: drafter unavailable" in lines[0]
    assert f"degraded: {OPEN_AFTER} calls in a row late or failed" in lines[1]
    assert "answers in time again" in lines[2]
    assert "is back after" in lines[3]
    assert not any(r.exc_info for r in caplog.records)  # an expected outage carries no traceback
    assert f"{engine.num_fallbacks('remote')} steps ran with K = 0" in lines[3]
    assert not engine.drafts.breakers["remote"].is_open
