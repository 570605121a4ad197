"""What drafting costs a step (draft_cost.py), the deadline that follows it (draft_deadline.py), and the planner
weighing it: a draft model whose K forwards cost more than the tokens they win is not asked, a cheap one is."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.proposer import Draft
from services.common.token_history import TokenHistory
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


def test_an_ask_of_every_row_is_priced_apart_from_a_probe_of_a_few():
    """A drafter service handles each row it is asked about: at 64 chats over gRPC an ask of every row took 8-24 ms
    where a probe of a row or two took under 1, and priced as one figure by k, the probes' calls priced the batch's."""
    model = DraftCostModel()
    model.observe(1, 0.0008, rows=1)
    assert model.predict(1, 64) == pytest.approx(0.0008)  # one class of sizes known: its figure for every size
    model.observe(1, 0.009, rows=64)
    assert model.predict(1, 64) == pytest.approx(0.009) and model.predict(1, 1) == pytest.approx(0.0008)
    assert model.predict(1, 100) == pytest.approx(0.009)  # its own class (64-127) measured: that class's figure
    assert model.predict(2, 64) == pytest.approx(0.018)  # proportional to k within a class, as from one point
    # a size no ask had yet (16-31 rows): the line through the classes by the rows they asked
    assert model.predict(1, 16) == pytest.approx(0.0008 + (0.009 - 0.0008) * 15 / 63)
    model.observe(1, 0.011, rows=100)  # a class's rows and seconds are moving averages
    assert model.classes[7].rows == pytest.approx(64 + 0.2 * 36)
    assert model.predict(1, 64) == pytest.approx(0.009 + 0.2 * 0.002)


def test_the_deadline_of_an_ask_of_many_rows_follows_such_asks():
    deadline = DraftDeadline(floor_s=0.005, cap_s=1.0)
    deadline.answered(1, 0.002, rows=1)
    deadline.answered(1, 0.02, rows=64)
    assert deadline.for_call(1, 1) == 0.005  # the floor
    assert deadline.for_call(1, 64) == pytest.approx(DEADLINE_FACTOR * 0.02)


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
    """What the collector reads of a decoding request: its id, its tokens (as RequestState.committed_view gives
    them), its proposer's name, its sampling (greedy here) and its kept target states (none here)."""
    speculation = SimpleNamespace(method=method, draft_pipelining=None, prediction=())
    sampling = SimpleNamespace(greedy=True, temperature=0.0)
    return [SimpleNamespace(request_id=f"r{i}", committed_view=TokenHistory([1, 2, 3]).view,
                            request=SimpleNamespace(speculation=speculation, sampling=sampling),
                            hidden=None, hidden_states=lambda: None)  # RequestState's: no target states kept
            for i in range(count)]


async def test_a_proposer_known_to_be_slower_than_the_floor_is_waited_for():
    proposer = SlowProposer(0.05)
    collector = DraftCollector({"slow": proposer}, 100, draft_timeout_s=0.2, max_draft_timeout_s=1.0)
    states = decode_states("slow", 2)
    assert all(d.tokens for d in await collector.collect(states, [3, 3]))
    proposer.seconds = 0.3  # slower than the floor and than twice what its calls took so far
    assert not any(d.tokens for d in await collector.collect(states, [3, 3]))  # missed: K = 0 this step
    assert collector.num_fallbacks("slow") == 1
    known = DraftCostModel()
    known.observe(3, 0.25)  # its calls of 3 tokens have been taking 0.25 s
    collector.deadline("slow").cost = known
    assert collector.deadline("slow").for_call(3) == pytest.approx(0.5)
    assert all(d.tokens for d in await collector.collect(states, [3, 3]))  # waited for
    assert collector.num_fallbacks("slow") == 1


def test_an_expensive_draft_model_is_not_asked_and_a_cheap_one_is():
    cost = FixedCost()  # a verify step of 4 rows: ~20-35 ms by width
    good = [0.8] * 5
    assert best_width([good] * 4, 256, cost, draft_s=lambda k: 0.002 * k) == 6
    assert best_width([good] * 4, 256, cost, draft_s=lambda k: 0.2 * k) == 1  # 200 ms a token: not worth it
    assert best_width([good] * 4, 256, cost, draft_s=None) == 6  # drafting already paid (after the drafts came)


def test_a_figure_not_measured_again_fades_and_a_stale_one_is_replaced():
    """A high figure stops the asking that would refresh it, so it must fade: half after HALF_LIFE_STEPS steps once
    it is stale."""
    from services.verifier.draft_cost import HALF_LIFE_STEPS, STALE_STEPS

    model = DraftCostModel()
    model.observe(2, 0.016)  # one slow call (a pause, the link opening)
    for _ in range(STALE_STEPS + HALF_LIFE_STEPS):
        model.age()
    assert model.predict(2) == pytest.approx(0.008)
    model.observe(2, 0.0005)  # asked again: the stale figure is replaced, not averaged
    assert model.predict(2) == pytest.approx(0.0005)
    model.age()
    model.observe(2, 0.0015)  # a fresh one is averaged
    assert model.predict(2) == pytest.approx(0.0005 + 0.2 * 0.001, rel=0.02)


def test_the_line_kept_between_steps_is_the_line_fitted_again():
    """The line is fitted again only when a call was observed or some figure fades: at every step of a history
    that goes stale, fades, is measured again and goes stale again, it is exactly what a fresh fit gives."""
    import copy
    import random

    from services.verifier.draft_cost import STALE_STEPS

    rng = random.Random(5)
    model = DraftCostModel()
    for step in range(4 * STALE_STEPS):
        if step % 150 < 20 and rng.random() < 0.5:  # asked in bursts, then not for longer than a figure stays fresh
            model.observe(rng.choice([1, 2, 4]), rng.uniform(0.001, 0.01), renews=rng.random() < 0.7,
                          rows=rng.choice([1, 3, 40]))
        refitted = DraftCostModel(copy.deepcopy(model.classes), model.steps, model.observations, model.oldest)
        assert [model.predict(k, rows) for k in (1, 3, 5) for rows in (1, 6, 64)] == [
            refitted.predict(k, rows) for k in (1, 3, 5) for rows in (1, 6, 64)]
        model.age()


def test_a_figure_measured_now_and_then_keeps_its_value_and_a_probe_resets_a_stale_one():
    """A batch that asks its drafter every few dozen steps (asking rarely pays) must not see its calls as cheaper
    than they are between asks: that made it ask at a loss. So a figure stands as measured for STALE_STEPS; after
    that the next measurement (a probe's, when the figure stopped the asking) replaces it."""
    from services.verifier.draft_cost import STALE_STEPS

    model = DraftCostModel()
    model.observe(1, 0.004)
    for _ in range(STALE_STEPS):
        model.age()
    assert model.predict(1) == pytest.approx(0.004)
    model.observe(1, 0.030)  # a pause
    assert model.predict(1) > 0.008
    for _ in range(STALE_STEPS):
        model.age()
    model.observe(1, 0.004)  # a probe's call, after the planner stopped asking
    assert model.predict(1) == pytest.approx(0.004)


def test_a_probes_call_is_averaged_in_but_does_not_keep_a_figure_from_going_stale():
    from services.verifier.draft_cost import SMOOTHING, STALE_STEPS

    model = DraftCostModel()
    model.observe(1, 0.200)  # a pause
    for _ in range(STALE_STEPS // 2):
        model.age()
    model.observe(1, 0.001, renews=False)  # a probe's call: averaged in
    assert model.predict(1) == pytest.approx(0.200 + SMOOTHING * (0.001 - 0.200))
    for _ in range(STALE_STEPS // 2):
        model.age()
    model.observe(1, 0.001, renews=False)  # the figure is stale all the same (its age is the pause's): replaced
    assert model.predict(1) == pytest.approx(0.001)


class OpeningProposer:
    """Drafts a reference text exactly; its first call for a sequence takes `opening_s` (as a drafter service's first
    call does: the link, the whole prompt, the head's prefill), later ones nothing. Counts its calls."""

    method = "opening"

    def __init__(self, references, opening_s: float) -> None:
        from tests.proposers import OracleProposer

        self.oracle = OracleProposer(references)
        self.opening_s, self.seen, self.calls = opening_s, set(), 0

    async def propose(self, inputs):
        self.calls += 1
        if any(item.seq_id not in self.seen for item in inputs):
            self.seen.update(item.seq_id for item in inputs)
            await asyncio.sleep(self.opening_s)
        return await self.oracle.propose(inputs)

    def release(self, seq_id) -> None:
        pass


async def test_a_slow_first_call_does_not_stop_the_asking():
    """On an accelerator a step takes a few ms and a drafter's first call for a request tens: measured as what a step's
    drafting costs, it made the planner stop asking for good (issue 29's EAGLE and code-edit shortfalls)."""
    from services.modeling.llama_runner import LlamaFamilyRunner
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
    from tests.engine_harness import run_schedule
    from tests.tiny_models import tiny_llama

    model = tiny_llama(seed=3)
    prompt = (5, 6, 7, 8, 9, 10, 11, 12)
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    plain = Engine(LlamaFamilyRunner(model, 2, 96), EngineConfig(log_stats_interval_s=0, profile_step_cost=False), {})
    reference = (await run_schedule(plain, {0: [GenerationRequest("r", prompt, greedy)]}))["r"].tokens
    proposer = OpeningProposer({"r": prompt + tuple(reference)}, opening_s=0.05)
    config = EngineConfig(log_stats_interval_s=0, profile_step_cost=False)
    engine = Engine(LlamaFamilyRunner(model, 2, 96), config, {"opening": proposer})
    engine.planner.cost = FixedCost(base=0.0034, per_row=0.0, per_token=0.0)  # an accelerator's step: 3.4 ms, any width
    out = await run_schedule(engine, {0: [GenerationRequest("r", prompt, greedy, SpeculationParams("opening", 2))]})
    assert out["r"].tokens == reference
    assert proposer.calls >= 10  # about one call a step for 40 tokens at 3 a step (the first call measured: 1 or 2)


def test_an_ask_that_opens_rows_teaches_what_an_opening_costs_and_its_class_what_it_costs_less_them():
    """A row's first ask opens it on the drafter. What an ask that opens rows took beyond what the figures say such
    an ask takes is the openings', per row opened, and what it took less them is its class's; before any figure the
    ask is left out (a first call's one-time costs must not stop the asking)."""
    from services.verifier.draft_cost import SMOOTHING

    model = DraftCostModel()
    model.observe_opening(2, 0.050, renews=True, rows=1, opened=1)  # nothing known: left out
    assert model.predict(2, 1) == 0.0 and not model.openings_known
    model.observe(2, 0.004, rows=1)
    model.observe_opening(2, 0.024, renews=True, rows=1, opened=1)  # 20 ms beyond the class's 4
    assert model.openings_known and model.opening_s == pytest.approx(0.020)
    assert model.predict(2, 1) == pytest.approx(0.004)  # less the opening: what the class said
    model.observe_opening(2, 0.104, renews=True, rows=40, opened=4)  # another class: the line through the others
    assert model.opening_s == pytest.approx(0.020 + SMOOTHING * ((0.104 - 0.004) / 4 - 0.020))
    assert model.predict(2, 40) == pytest.approx(0.104 - 4 * model.opening_s)  # its class: less its openings
    before = model.opening_s
    model.observe_opening(2, model.predict(2, 40), renews=True, rows=40, opened=1)  # an opening that cost nothing
    assert model.opening_s == pytest.approx((1 - SMOOTHING) * before)
    free = DraftCostModel()  # where openings cost nothing, asks above and below their figure balance out
    free.observe(2, 0.004, rows=8)
    for seconds in (0.0045, 0.0035) * 20:
        free.observe_opening(2, seconds, renews=True, rows=8, opened=2)
    assert free.opening_s < 0.0001


def test_a_class_measured_again_fades_no_lower_than_its_lowest_measurement_which_fades_slower():
    """Asks that rarely pay are rarely measured: faded to nothing between them, an expensive drafter's figure at 64
    rows made the planner ask again and again at a loss. A class measured twice fades toward the lowest of its last
    measurements (at any k), never above its own figure unfaded, and that floor fades ten times slower."""
    from services.verifier.draft_cost import FLOOR_HALF_LIFE_STEPS, HALF_LIFE_STEPS, STALE_STEPS

    model = DraftCostModel()
    model.observe(3, 0.018, rows=64)
    model.observe(1, 0.016, rows=64)  # a probe's k: two measurements of the class
    for _ in range(STALE_STEPS + 4 * HALF_LIFE_STEPS):
        model.age()
    floor = 0.016 * 0.5 ** (4 * HALF_LIFE_STEPS / FLOOR_HALF_LIFE_STEPS)
    assert model.predict(3, 64) == pytest.approx(floor, rel=0.05)  # not 0.018 / 16
    assert model.predict(1, 64) == pytest.approx(floor, rel=0.05)
    single = DraftCostModel()
    single.observe(3, 0.018, rows=64)  # measured once (a first call's one-time costs, maybe): fades as before
    for _ in range(STALE_STEPS + 4 * HALF_LIFE_STEPS):
        single.age()
    assert single.predict(3, 64) == pytest.approx(0.018 / 16, rel=0.05)
    fresh = DraftCostModel()
    fresh.observe(4, 0.020, rows=64)
    fresh.observe(4, 0.018, rows=64)
    fresh.observe(1, 0.002, rows=64)  # current figures: the floor (0.002 of k = 1) does not touch k = 4
    assert fresh.predict(4, 64) > 0.015


def test_the_plan_prices_the_openings_of_the_rows_an_ask_would_open():
    """A batch of rows never asked, whose drafter takes 50 ms to open each: an ask of them is not worth a step's few
    tokens, and the plan asks none (a probe opens them, rationed); once they are open, asks cost what asks cost."""
    from services.verifier.speculation_planner import SpeculationPlanner
    from tests.unit.test_plan_rows import decoding_rows

    planner = SpeculationPlanner(FixedCost(), adaptive=True)  # a verify step of 4 rows: ~20-35 ms by width
    decode = decoding_rows(planner, 4)
    for state in decode:
        state.speculation.acceptance.method.observe(4, 4)  # drafts are good
    planner.draft_cost.observe(4, 0.001, rows=4)
    planner.draft_cost.observe_opening(4, 0.001 + 4 * 0.050, renews=True, rows=4, opened=4)  # 50 ms an opening
    assert planner.draft_cost.opening_s == pytest.approx(0.050)
    asks = planner.draft_requests(decode, [4] * 4)
    assert len(planner.row_figures.unopened_remaining) == 4 and not any(asks)
    for state in decode:
        state.speculation.asked_before = True  # opened (by probes, say)
    planner.row_figures.changed()
    assert planner.draft_requests(decode, [4] * 4) == [4] * 4 and not planner.row_figures.unopened_remaining


def test_a_probe_asks_only_as_many_rows_never_asked_as_a_plain_step_pays_the_openings_of():
    """Due rows probe together, but rows never asked are opened by the probe: 16 of them at 5 ms each against a plain
    step of about 20 ms would take four steps' time in one. The probe asks the longest due of them that a plain
    step's time pays for (at least one), and every due row once they are open."""
    from services.verifier.draft_collection import ProposedDraft
    from services.verifier.speculation_planner import SpeculationPlanner
    from tests.unit.test_plan_rows import decoding_rows

    planner = SpeculationPlanner(FixedCost(base=0.016, per_row=0.0001, per_token=0.0001), adaptive=True)
    decode = decoding_rows(planner, 16)
    for state in decode:
        state.speculation.acceptance.method.observe(4, 0)  # drafts are poor: plain steps, and probes
    planner.draft_cost.observe(1, 0.0005, rows=16)
    planner.draft_cost.observe_opening(1, 0.0005 + 2 * 0.005, renews=True, rows=16, opened=2)  # 5 ms an opening
    opened_by_probe = []
    for _ in range(60):
        never_asked = [not state.speculation.asked_before for state in decode]
        asks = planner.draft_requests(decode, [4] * 16)
        if any(asks):
            opened_by_probe.append(sum(bool(ask) and new for ask, new in zip(asks, never_asked, strict=True)))
        planner.choose_drafts(decode, [ProposedDraft([], None)] * 16)
        planner.settle_probe(0.02)
    assert len(opened_by_probe) >= 5 and max(opened_by_probe) <= 4 and min(opened_by_probe[:5]) >= 1  # 20 ms at most
    for state in decode:
        state.speculation.asked_before = True
        state.speculation.probe.since = -100  # all due
    planner.row_figures.changed()
    planner.probes.credit_s = 1.0  # affordable
    assert sum(planner.draft_requests(decode, [4] * 16)) == 16  # open: every due row in one call


def test_a_late_call_that_opened_rows_teaches_nothing_of_what_openings_cost():
    """A hung drafter's calls take their deadline. Taken for what opening its rows cost, the first priced every
    later opening at half a second: the asking stopped, and the breaker never saw the misses that open it."""
    from services.verifier.speculation_planner import SpeculationPlanner
    from tests.unit.test_plan_rows import decoding_rows

    planner = SpeculationPlanner(FixedCost(), adaptive=True)
    planner.draft_cost.observe(4, 0.001, rows=4)
    decode = decoding_rows(planner, 4)
    for answered in (False, True):
        for state in decode:
            state.speculation.asked_before = False  # each round opens the rows again (new requests, say)
        planner.row_figures.changed()
        k = max(planner.draft_requests(decode, [4] * 4))
        assert k > 0  # nothing known of openings: asked
        planner.observe_drafting(k, 0.5 if not answered else planner.draft_cost.predict(k, 4) + 4 * 0.002,
                                 answered=answered)
        assert planner.draft_cost.openings_known == answered
    assert planner.draft_cost.opening_s == pytest.approx(0.002)


def test_a_probe_that_opened_rows_is_charged_a_step_more_for_each_it_opened():
    """A probing step that took far longer than planned is charged at most PROBE_CHARGE_STEPS plain steps (a
    one-off stall must not silence probing), and one more for each row it opened: opening new rows is no
    accident, every new request needs it, and capped at four steps an EAGLE-like probe that opened 64 rows was
    charged a fraction of its cost."""
    from services.verifier.draft_collection import ProposedDraft
    from services.verifier.row_speculation import PROBE_CHARGE_STEPS
    from services.verifier.speculation_planner import SpeculationPlanner
    from tests.unit.test_plan_rows import decoding_rows

    charged = {}
    for opened_before in (False, True):
        planner = SpeculationPlanner(FixedCost(base=0.016, per_row=0.0001, per_token=0.0001), adaptive=True)
        decode = decoding_rows(planner, 16)
        for state in decode:
            state.speculation.acceptance.method.observe(4, 0)  # drafts are poor: plain steps, and probes
            state.speculation.asked_before = opened_before
            state.speculation.probe.since = -100  # all due
        planner.draft_cost.observe(1, 0.0005, rows=16)  # a call's figure; nothing known of openings: all probe
        planner.row_figures.changed()
        planner.probes.credit_s = 1.0
        asks = planner.draft_requests(decode, [4] * 16)
        assert sum(asks) == 16
        probe = planner._probe_step
        assert probe.opened == (0 if opened_before else 16)
        credit = planner.probes.credit_s + probe.charged_s  # before the probe was charged anything
        planner.choose_drafts(decode, [ProposedDraft([], None)] * 16)
        planner.settle_probe(probe.expected_s * 100)  # a hundred plain steps' time
        charged[opened_before] = (credit - planner.probes.credit_s) / probe.expected_s
    assert charged[True] == pytest.approx(PROBE_CHARGE_STEPS)
    assert charged[False] == pytest.approx(PROBE_CHARGE_STEPS + 16)
