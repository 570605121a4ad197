"""What drafting costs a step (draft_cost.py), the deadline that follows it (draft_deadline.py), and the planner
weighing it: a draft model whose K forwards cost more than the tokens they win is not asked, a cheap one is."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.proposer import Draft
from services.verifier.draft_collection import DraftCollector
from services.verifier.draft_cost import DraftCostModel
from services.verifier.draft_deadline import DEADLINE_FACTOR, DraftDeadline
from services.verifier.speculation_planner import best_width
from tests.step_costs import FixedCost


def test_cost_is_proportional_to_k_from_one_point_and_a_line_from_more():
    model = DraftCostModel()
    assert model.predict(3) == 0.0  # nothing seen: no cost assumed
    model.observe(4, 0.2)
    assert model.predict(2) == pytest.approx(0.1) and model.predict(0) == 0.0
    model.observe(1, 0.08)  # a fixed part (round trip, catch-up) and a part per token
    assert model.predict(1) == pytest.approx(0.08) and model.predict(4) == pytest.approx(0.2)
    assert model.predict(7) == pytest.approx(0.32)
    model.observe(4, 0.3)  # a moving average per k: one slow call moves it part of the way
    assert 0.2 < model.predict(4) < 0.3


def test_the_deadline_follows_answered_calls_between_floor_and_cap():
    deadline = DraftDeadline(floor_s=0.5, cap_s=2.0)
    assert deadline.for_call(5) == 0.5
    deadline.answered(5, 0.4)  # a draft model's five forwards
    assert deadline.for_call(5) == pytest.approx(DEADLINE_FACTOR * 0.4)
    assert deadline.for_call(1) == 0.5  # a short call keeps the floor
    deadline.answered(5, 5.0)
    assert deadline.for_call(5) == 2.0


class SlowProposer:
    method = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def propose(self, inputs):
        await asyncio.sleep(self.seconds)
        return [Draft([1] * item.num_speculative_tokens) for item in inputs]

    def release(self, seq_id) -> None:
        pass


def decode_states(method: str, count: int) -> list[SimpleNamespace]:
    """What the collector reads of a decoding request: its id, its tokens, its proposer's name, its sampling (greedy
    here) and its kept target states (none here)."""
    speculation = SimpleNamespace(method=method, draft_pipelining=None)
    sampling = SimpleNamespace(greedy=True, temperature=0.0)
    return [SimpleNamespace(request_id=f"r{i}", token_ids=[1, 2, 3],
                            request=SimpleNamespace(speculation=speculation, sampling=sampling),
                            hidden_states=lambda: None)  # RequestState's: no target states kept
            for i in range(count)]


async def test_a_proposer_known_to_be_slower_than_the_floor_is_waited_for():
    proposer = SlowProposer(0.05)
    collector = DraftCollector({"slow": proposer}, 100, draft_timeout_s=0.2, max_draft_timeout_s=1.0)
    states = decode_states("slow", 2)
    assert all(d.tokens for d in await collector.collect(states, [3, 3]))
    proposer.seconds = 0.3  # slower than the floor and than twice what its calls took so far
    assert not any(d.tokens for d in await collector.collect(states, [3, 3]))  # missed: K = 0 this step
    assert collector.num_fallbacks("slow") == 1
    collector.deadline("slow").cost.seconds_by_k[3] = 0.25  # its calls of 3 tokens have been taking 0.25 s
    assert collector.deadline("slow").for_call(3) == pytest.approx(0.5)
    assert all(d.tokens for d in await collector.collect(states, [3, 3]))  # waited for
    assert collector.num_fallbacks("slow") == 1


def test_an_expensive_draft_model_is_not_asked_and_a_cheap_one_is():
    cost = FixedCost()  # a verify step of 4 rows: ~20-35 ms by width
    good = [0.8] * 5
    assert best_width([good] * 4, 256, cost, draft_s=lambda k: 0.002 * k) == 6
    assert best_width([good] * 4, 256, cost, draft_s=lambda k: 0.2 * k) == 1  # 200 ms a token: not worth it
    assert best_width([good] * 4, 256, cost, draft_s=None) == 6  # drafting already paid (after the drafts came)
