"""Sampled output with pipelined drafting follows the target's distribution (chi-square, as
test_engine_distribution.py), measured on the tokens a pre-draft proposes: with K = 1 the first speculative step
commits t2 (and t3 when its draft is accepted), and the pre-draft made meanwhile drafts t4 on the guess that it
was. So the pair (t3, t4) is checked, with a drafter whose guesses hold, one whose pre-drafts are keyed to a
wrong guess (stale drafts are answered: the verifier checks them like any other), and one that answers late."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from services.drafter.draft_pipelining import PreDraft
from services.drafter.methods.draft_model import DraftModelProposer
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.stats import ALPHA, chi_square_p_value, reference_processed, total_variation
from tests.tiny_models import tiny_llama
from tests.unit.test_draft_pipelining import after_each_predraft

V = 12
PROMPT = (1, 5, 2, 7, 1, 5)
SAMPLES = 3000
PARAMS = SamplingParams(temperature=0.6, max_tokens=5, ignore_eos=True)
LATE_S = 1.0


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=21, vocab_size=V)


def exact_joint_of_third_and_fourth(model, params: SamplingParams) -> np.ndarray:
    """p(t3, t4) = sum over t1, t2 of p(t1) p(t2 | t1) p(t3 | t1, t2) p(t4 | t1, t2, t3)."""
    def next_probs(prefixes: list[tuple[int, ...]]) -> np.ndarray:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].numpy()
        return np.stack([reference_processed(row, params) for row in logits])

    grid = [()]
    probs = np.ones(1)
    for _ in range(4):  # extend every prefix by each token, weighting by its probability
        step = next_probs(grid)
        probs = (probs[:, None] * step).ravel()
        grid = [p + (t,) for p in grid for t in range(V)]
    return probs.reshape(V, V, V, V).sum(axis=(0, 1))


class AnswersLate:
    """Answers every other call after the engine's deadline (the engine goes on without it and drops it)."""

    def __init__(self, inner: DraftModelProposer) -> None:
        self.inner, self.method, self.capabilities, self.calls = inner, inner.method, inner.capabilities, 0

    async def propose(self, inputs):
        drafts = await self.inner.propose(inputs)
        self.calls += 1
        if self.calls % 2 == 0:
            await asyncio.sleep(LATE_S)
        return drafts

    def release(self, seq_id) -> None:
        self.inner.release(seq_id)


def keyed_to_a_wrong_guess(proposer: DraftModelProposer) -> None:
    """Every pre-draft is kept for the bonus token after the one it guessed: when the target's bonus is that
    other token, the pre-draft (drafted after the guessed one) is answered although it is stale."""
    predrafts = proposer._drafter.predrafts
    keep = predrafts.keep

    def keep_wrong(seq_id, predraft: PreDraft) -> None:
        base = predraft.base.copy()
        base[-1] = (base[-1] + 1) % V
        keep(seq_id, PreDraft(base, predraft.tokens, predraft.seconds))

    predrafts.keep = keep_wrong


@pytest.mark.parametrize("drafter", ["guesses hold", "guesses always wrong", "answers late"])
async def test_pipelined_samples_follow_the_target(target, drafter):
    inner = DraftModelProposer(LlamaFamilyRunner(target, 500, 16, pack_weights=False))
    proposer = inner
    if drafter == "guesses hold":
        after_each_predraft(inner)  # the verifier is slower than the drafter: every pre-draft finishes
    elif drafter == "guesses always wrong":
        after_each_predraft(inner)
        keyed_to_a_wrong_guess(inner)
    else:
        proposer = AnswersLate(inner)
    deadline = LATE_S / 2 if drafter == "answers late" else 30.0
    engine = Engine(LlamaFamilyRunner(target, max_num_seqs=500, max_model_len=16),
                    EngineConfig(max_num_batched_tokens=4096, max_waiting_requests=SAMPLES, log_stats_interval_s=0,
                                 adaptive_speculation=False, draft_timeout_s=deadline, max_draft_timeout_s=deadline),
                    {"draft_model": proposer})
    spec = SpeculationParams("draft_model", 1, draft_pipelining=True)
    requests = [GenerationRequest(f"s{i}", PROMPT, SamplingParams(**{**PARAMS.__dict__, "seed": 500 + i}), spec)
                for i in range(SAMPLES)]
    try:
        results = await run_schedule(engine, {0: requests})
    finally:
        inner.close()
    joint = np.zeros((V, V))
    for result in results.values():
        joint[result.tokens[2], result.tokens[3]] += 1
    counts = inner.pipeline_counts
    if drafter == "answers late":
        # pre-drafts were made; how many were used depends on timing here (no wait for them), so it is not asked
        assert engine.stats.num_late_proposals > 0 and counts.used + counts.discarded > 0
    else:
        assert counts.used > 10, counts  # tokens verified against pre-drafts, stale ones in the second case
    expected = exact_joint_of_third_and_fourth(target, PARAMS)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)


async def test_the_statistic_sees_a_wrong_distribution_of_the_third_and_fourth_tokens(target):
    """Negative control: samples at this temperature against the pair's distribution at another."""
    engine = Engine(LlamaFamilyRunner(target, max_num_seqs=500, max_model_len=16),
                    EngineConfig(max_num_batched_tokens=4096, max_waiting_requests=SAMPLES, log_stats_interval_s=0),
                    {})
    requests = [GenerationRequest(f"s{i}", PROMPT, SamplingParams(**{**PARAMS.__dict__, "seed": 500 + i}))
                for i in range(SAMPLES)]
    results = await run_schedule(engine, {0: requests})
    joint = np.zeros((V, V))
    for result in results.values():
        joint[result.tokens[2], result.tokens[3]] += 1
    other = SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True)
    assert chi_square_p_value(joint, exact_joint_of_third_and_fourth(target, PARAMS)) > ALPHA
    assert chi_square_p_value(joint, exact_joint_of_third_and_fourth(target, other)) < ALPHA
