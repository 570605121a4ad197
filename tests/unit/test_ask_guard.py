"""The ask guard (services/verifier/ask_guard.py): a load whose asking steps realized less than its plain steps
stops asking for a while, then is measured afresh; a load where asking pays, however unevenly, never stops; and
through the planner, a paused load's plan asks nothing."""

import random

from services.verifier.ask_guard import MARGIN, PAUSE_STEPS, WINDOW, AskGuard
from services.verifier.draft_collection import ProposedDraft
from services.verifier.speculation_planner import SpeculationPlanner

from tests.unit.test_speculation_planner import accelerator_planner, decoding_states


def test_asking_that_realizes_less_stops_for_a_while_then_is_measured_afresh():
    guard, step = AskGuard(), 0
    for _ in range(WINDOW):  # 64 rows: a plain step 64 tokens in 5 ms, as predicted
        step += 1
        guard.observe(64, False, 64, 0.005, 0.005, step)
    for i in range(WINDOW):  # asking steps: 28% more tokens for 62% more time (the H200's, stop 74)
        step += 1
        assert guard.allows(64, step), i  # no verdict before the window is full
        guard.observe(64, True, 82, 0.0081, 0.005, step)
    assert guard.pauses == 1
    assert guard.describe() == "asking against plain by rows: 64-127 rows 0.79x (48 asking, 48 plain); pauses 1"
    assert not guard.allows(64, step + 1) and not guard.allows(100, step + PAUSE_STEPS)  # 64-127 rows: one bucket
    assert guard.allows(60, step + 1) and guard.allows(8, step + 1)  # other loads are their own
    assert guard.allows(64, step + PAUSE_STEPS + 1)  # over: asked again, its old asking steps forgotten
    guard.observe(64, True, 82, 0.0081, 0.005, step + PAUSE_STEPS + 2)
    assert guard.allows(64, step + PAUSE_STEPS + 3) and guard.pauses == 1  # a full window again before a verdict


def test_asking_that_pays_unevenly_never_stops_nor_does_a_loss_within_the_margin():
    """One request, asking steps that commit 1 token mostly and up to 5 now and then (1.4 on average, ngram on
    chat text) in 6% more time: 32% faster than plain steps, with their spread, over 20,000 steps."""
    rng, guard = random.Random(0), AskGuard()
    for step in range(20_000):
        if rng.random() < 0.5:
            guard.observe(1, False, 1, 0.0028 * rng.uniform(0.9, 1.1), 0.0028, step)
        else:
            accepted = min(4, int(rng.expovariate(1 / 0.4) * 1.0)) if rng.random() < 0.45 else 0
            guard.observe(1, True, 1 + accepted, 0.00297 * rng.uniform(0.9, 1.1), 0.0028, step)
    assert guard.pauses == 0
    near = AskGuard()  # a loss smaller than the margin is left to the planner's model
    for step in range(WINDOW):
        near.observe(64, False, 64, 0.005, 0.005, step)
        near.observe(64, True, 64, 0.005 / (1 - MARGIN / 2), 0.005, step)
    assert near.pauses == 0 and near.allows(64, WINDOW)


def test_rows_of_one_bucket_compare_by_the_plain_step_predicted_for_them():
    """Plain steps at 40 rows and asking steps at 63 in one bucket: a step of 63 rows takes longer, as predicted,
    and commits more; what it realized against its own prediction is what counts."""
    guard = AskGuard()
    for step in range(2 * WINDOW):
        guard.observe(40, False, 40, 0.0045, 0.0045, step)
        guard.observe(63, True, 63, 0.0058, 0.0055, step)  # 5% over its prediction: within the margin
    assert guard.pauses == 0


def test_a_paused_load_plans_no_asks_but_its_probes():
    planner, _ = accelerator_planner()
    decode = decoding_states(4, "ngram", 4)
    for state in decode:
        state.speculation = planner.start("ngram")
    assert any(planner.draft_requests(decode, [4] * 4))  # the model asks: a flat step, fresh priors
    guard: AskGuard = planner.ask_guard
    for step in range(WINDOW):
        guard.observe(4, False, 4, 0.004, 0.004, step)
        guard.observe(4, True, 4, 0.006, 0.004, step)  # asked, nothing gained, half again the time
    assert guard.pauses == 1
    probed = 0
    for _ in range(300):
        asks = planner.draft_requests(decode, [4] * 4)
        assert all(ask <= 1 for ask in asks)  # a probe asks one token at most; the plan asks nothing
        probed += any(asks)
        planner.choose_drafts(decode, [_no_draft()] * 4)
        planner.settle_probe(0.004)
    assert probed  # probes go on: they keep measuring acceptance and keep calling the drafter


def _no_draft() -> ProposedDraft:
    return ProposedDraft([], None)


def _step(planner: SpeculationPlanner, decode, seconds: float, answered: bool = True) -> list[int]:
    """One decode-only step through the planner as the engine takes it, no row getting a draft; its asks."""
    asks = planner.draft_requests(decode, [4] * len(decode))
    planner.observe_drafting(max(asks), 0.0005, answered)
    planner.choose_drafts(decode, [_no_draft()] * len(decode))
    planner.settle_probe(seconds)
    return asks


def test_the_planner_hands_on_its_asking_and_plain_steps_but_not_late_calls_nor_probes():
    """Through the planner as the engine drives it: a step whose plan asked and whose drafter answered is weighed
    as asking; one whose drafter was late or failed is not (its time holds a missed deadline, the breaker's to act
    on); a plain step is weighed as plain; a step that only probed is not the plan's asking; and with adaptive
    speculation off nothing is planned, so nothing is weighed."""
    planner, cost = accelerator_planner()
    decode = decoding_states(4, "ngram", 4)
    for state in decode:
        state.speculation = planner.start("ngram")
    bucket = lambda: planner.ask_guard._buckets.get(4 .bit_length())  # noqa: E731
    assert any(_step(planner, decode, 0.006))
    assert len(bucket().asked) == 1 and not bucket().plain
    assert any(_step(planner, decode, 0.5, answered=False))  # late: not weighed
    assert len(bucket().asked) == 1
    for state in decode:  # rows whose drafts are never accepted: the plan stops asking
        for _ in range(30):
            state.speculation.acceptance.observe(4, 0)
    planner.row_figures.changed()
    kinds = []
    while len(bucket().plain) < WINDOW:
        before = len(bucket().plain)
        asks = _step(planner, decode, 0.004)
        kinds.append("probed" if any(asks) else "plain")
        assert len(bucket().plain) == before + (kinds[-1] == "plain")  # a plain step weighed, a probe not
    assert "probed" in kinds
    assert len(bucket().asked) == 1
    off = SpeculationPlanner(cost, adaptive=False)
    rows = decoding_states(2, "ngram", 4)
    _step(off, rows, 0.010)
    assert not off.ask_guard._buckets


def test_a_late_call_does_not_pause_asking():
    """A drafter that keeps missing its deadline (the steps that ask it take 100x a plain step) never pauses a
    load's asking: its breaker decides about it, and must go on seeing its calls."""
    planner, _ = accelerator_planner()
    decode = decoding_states(4, "ngram", 4)
    for state in decode:
        state.speculation = planner.start("ngram")
    for step in range(WINDOW):
        planner.ask_guard.observe(4, False, 4, 0.004, 0.004, step)
    asked = sum(any(_step(planner, decode, 0.5, answered=False)) for _ in range(2 * WINDOW))
    assert asked >= 1  # (until its rows' draft rates fell: no call brought a draft)
    assert planner.ask_guard.pauses == 0 and not planner.ask_guard._buckets[4 .bit_length()].asked
