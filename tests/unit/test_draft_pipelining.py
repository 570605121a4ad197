"""Pipelined drafting (services/drafter/draft_pipelining.py) with tiny random models: a pre-draft is answered only
for exactly the committed tokens it guessed, so every draft equals the one a fresh drafter proposes, whether the
guess held (then the call runs no forward at all), failed, or was stopped by a call that came early; greedy output
through the engine is the same as without speculation."""

from __future__ import annotations

import os
import random

import numpy as np

from services.common.proposer import DraftInput
from services.drafter.draft_pipelining import default_pipelining
from services.drafter.methods.draft_model import DraftModelProposer
from services.drafter.model_drafting import DraftRequest, ModelDrafter
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.sampling_params import SpeculationParams
from tests.prompts import random_workload, repetitive_prompt
from tests.tiny_models import tiny_llama, tiny_qwen2
from tests.unit.test_draft_model import MAX_MODEL_LEN, commit, fresh_draft, make_engine, run_requests


def pipelined(model, max_num_seqs: int = 4) -> DraftModelProposer:
    return DraftModelProposer(LlamaFamilyRunner(model, max_num_seqs, MAX_MODEL_LEN, pack_weights=False),
                              pipelining=True)


def counting_forwards(proposer: DraftModelProposer) -> list[int]:
    calls: list[int] = []
    runner = proposer.runner
    forward = runner.forward
    runner.forward = lambda rows: calls.append(len(rows)) or forward(rows)
    return calls


async def test_a_guess_that_holds_answers_the_next_call_without_a_forward():
    model = tiny_qwen2(seed=21)
    proposer = pipelined(model)
    forwards = counting_forwards(proposer)
    committed = list(repetitive_prompt(random.Random(3), 20))
    try:
        for step in range(4):
            draft = tuple((await proposer.propose([DraftInput("a", committed, 3)]))[0].token_ids)
            assert draft == await fresh_draft(model, committed, 3), step
            await proposer.predrafting.running  # the verifier verifies meanwhile
            # the verifier accepts the whole draft and its bonus is the draft model's own next token
            committed = committed + list(draft) + list(await fresh_draft(model, committed + list(draft), 1))
            forwards.clear()
            ahead = tuple((await proposer.propose([DraftInput("a", committed, 3)]))[0].token_ids)
            assert forwards == [] and ahead == await fresh_draft(model, committed, 3), step
            await proposer.predrafting.running
            committed = committed + list(ahead[:1]) + [(ahead[1] + 1) % 96]  # now a rejection
        assert proposer.pipeline_counts.used == 4 and proposer.pipeline_counts.hidden_seconds > 0
    finally:
        proposer.close()


async def test_each_request_can_turn_pre_drafting_on_or_off_whatever_the_drafters_setting():
    model = tiny_qwen2(seed=21)
    committed = list(repetitive_prompt(random.Random(4), 20))
    for setting in (False, True):
        proposer = DraftModelProposer(LlamaFamilyRunner(model, 4, MAX_MODEL_LEN, pack_weights=False),
                                      pipelining=setting)
        try:
            inputs = [DraftInput("own", committed, 3), DraftInput("on", committed, 3, pipelining=True),
                      DraftInput("off", committed, 3, pipelining=False)]
            await proposer.propose(inputs)
            await proposer.predrafting.running
            assert set(proposer._drafter.predrafts._by_seq) == ({"own", "on"} if setting else {"on"})
        finally:
            proposer.close()


async def test_a_failed_guess_is_dropped_and_the_draft_is_a_fresh_drafters():
    model = tiny_qwen2(seed=21)
    rng = random.Random(5)
    proposer = pipelined(model)
    committed = list(repetitive_prompt(rng, 20))
    try:
        for step in range(10):
            k = rng.randint(1, 5)
            draft = (await proposer.propose([DraftInput("a", committed, k)]))[0].token_ids
            assert tuple(draft) == await fresh_draft(model, committed, k), step
            await proposer.predrafting.running
            committed = commit(rng, committed, draft)  # a random bonus: the guess practically never holds
        counts = proposer.pipeline_counts
        assert counts.used + counts.discarded == 9 and counts.discarded > 0
    finally:
        proposer.close()


async def test_a_call_that_comes_early_stops_the_predraft_and_drafts_as_fresh():
    model = tiny_qwen2(seed=21)
    drafter = ModelDrafter(LlamaFamilyRunner(model, 2, MAX_MODEL_LEN, pack_weights=False))
    committed = np.asarray(repetitive_prompt(random.Random(9), 16), dtype=np.int64)
    request = DraftRequest("a", committed, 4)
    draft = drafter.draft([request])[0]
    asked = []
    drafter.predraft([request], [draft], stop=lambda: asked.append(1) or len(asked) > 2)  # stops after 2 forwards
    assert drafter.predrafts.counts.discarded == 1 and drafter.predrafts.counts.used == 0
    guess = list(committed) + list(draft) + list(await fresh_draft(model, list(committed) + list(draft), 1))
    again = drafter.draft([DraftRequest("a", np.asarray(guess, dtype=np.int64), 4)])[0]
    assert again == await fresh_draft(model, guess, 4)  # the partly fed guess was kept in the slot and used


def after_each_predraft(proposer: DraftModelProposer) -> None:
    """A verifier slower than the drafter: each call waits for the pre-draft the last one started. Without this
    the tiny target's step can end before the pre-draft does (on a loaded machine it did), and every pre-draft is
    stopped by the next call, which then drafts as fresh: right, but nothing pipelined."""
    propose = proposer.propose

    async def propose_after_predraft(inputs):
        if proposer.predrafting.running is not None:
            await proposer.predrafting.running
        return await propose(inputs)

    proposer.propose = propose_after_predraft


async def test_greedy_output_with_pipelining_equals_no_speculation():
    target = tiny_llama(seed=3)
    prompts, max_tokens = random_workload(17, 6, (4, 40), (10, 40))
    baseline = await run_requests(make_engine(target, {}), prompts, max_tokens, SpeculationParams())
    drafters = [(tiny_llama(seed=3), False), (tiny_llama(seed=3), True),  # the target itself: its guesses hold
                (tiny_qwen2(seed=21), False)]  # another model
    for drafter, slow_verifier in drafters:
        proposer = pipelined(drafter, max_num_seqs=3)
        proposer.method = "draft_model"
        if slow_verifier:
            after_each_predraft(proposer)
        try:
            engine = make_engine(target, {"draft_model": proposer})
            result = await run_requests(engine, prompts, max_tokens, SpeculationParams("draft_model", 3))
            assert all(result[f"r{i}"].tokens == baseline[f"r{i}"].tokens for i in range(len(prompts)))
            assert engine.stats.num_fallbacks == 0
        finally:
            proposer.close()
        if slow_verifier:
            assert proposer.pipeline_counts.used > 0


def test_unset_pipelining_is_on_only_where_the_draft_model_has_compute_of_its_own(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert default_pipelining("cpu")[0] is False  # every CPU: it would compete with the verifier
    assert default_pipelining("cuda") == (True, "the draft model runs on cuda")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 7}, raising=False)  # --drafter-cpus 6,7
    on, why = default_pipelining("cpu")
    assert on and "2 of the machine's 8 CPUs" in why
