"""Adaptive speculation's parts on their own: acceptance estimates, the step-cost fit, the width choice and
re-probing (the engine-level tests are in test_engine_greedy.py and test_adaptive_speculation.py)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import numpy as np
import pytest

from services.verifier.acceptance import AcceptanceEstimate, MethodAcceptance, PositionCounts
from services.verifier.draft_collection import ProposedDraft
from services.verifier.row_speculation import PROBE_INTERVAL, PROBE_INTERVAL_MAX, ProbeSchedule
from services.verifier.speculation_planner import SpeculationPlanner, best_width, column_gains
from services.verifier.step_cost import StepCostModel, StepShape, non_negative_least_squares


def test_an_observation_teaches_the_accepted_run_and_the_first_rejection_only():
    counts = PositionCounts(decay=1.0)
    counts.observe(num_draft=5, num_accepted=2)
    assert counts.observed == [1.0, 1.0, 1.0]  # positions 4 and 5 were never judged
    assert counts.accepted == [1.0, 1.0, 0.0]
    counts.observe(num_draft=2, num_accepted=2)  # all accepted: no rejection to record
    assert counts.observed == [2.0, 2.0, 1.0]
    assert counts.accepted == [2.0, 2.0, 0.0]


def test_forgotten_counts_equal_decaying_every_position_at_each_observation_across_rescales():
    """The counts are held under a running scale (PositionCounts): they must read as decaying every position at
    every observation would, also after the scale has been folded into them (0.5 ** 100 < RESCALE_BELOW)."""
    lazy, rng = PositionCounts(decay=0.5), random.Random(5)
    accepted, observed = [], []
    for _ in range(300):
        num_draft = rng.randint(0, 6)
        num_accepted = rng.randint(0, num_draft)
        lazy.observe(num_draft, num_accepted)
        seen = min(num_accepted + 1, num_draft)
        if seen <= 0:
            continue
        accepted += [0.0] * (seen - len(accepted))
        observed += [0.0] * (seen - len(observed))
        accepted, observed = [a * 0.5 for a in accepted], [o * 0.5 for o in observed]
        for j in range(seen):
            observed[j] += 1.0
            accepted[j] += 1.0 if j < num_accepted else 0.0
        for position in range(1, len(observed) + 2):
            want = (accepted[position - 1], observed[position - 1]) if position <= len(observed) else (0.0, 0.0)
            assert lazy.at(position) == pytest.approx(want, rel=1e-12, abs=1e-300)
    assert lazy.observed == pytest.approx(observed, rel=1e-12) and lazy.accepted == pytest.approx(accepted, rel=1e-12)


def test_survival_is_the_product_of_conditionals_and_learns_per_request():
    method = MethodAcceptance()
    good, bad = AcceptanceEstimate(method), AcceptanceEstimate(method)
    for _ in range(30):
        good.observe(4, 4)
        bad.observe(4, 0)
    high, low = good.survival(4), bad.survival(4)
    assert all(a >= b for a, b in itertools.pairwise(high))  # a run: later positions are never likelier
    # each is pulled toward the other's record (the method's counts without its own): a few own drafts outweigh it
    assert high[3] > 0.6 and low[0] < 0.3
    fresh = AcceptanceEstimate(method)  # a new request starts from the method's record (half good, half bad)
    assert low[0] < fresh.survival(1)[0] < high[0]


def test_a_requests_estimate_follows_its_methods_prior_by_epochs():
    """Every verified draft moves the method's prior; a request's estimate is worked out again once the prior has
    moved by more than PRIOR_TOLERANCE (an epoch), or at once when the request's own draft is verified."""
    from services.verifier.acceptance import PRIOR_TOLERANCE

    method = MethodAcceptance()
    for i in range(100):  # a method with a record: one draft moves it by about a 50th
        method.observe(4, 2 * (i % 2))
    row = AcceptanceEstimate(method)
    epochs = {method.epoch}
    for _ in range(30):
        kept, epoch = row.survival(4), method.epoch
        method.observe(4, 4)  # another request's draft, all accepted
        fresh = AcceptanceEstimate(method).survival(4)  # no history of its own: the prior as it is now
        if method.epoch == epoch:
            assert row.survival(4) is kept and abs(kept[0] - fresh[0]) <= 2 * PRIOR_TOLERANCE
        else:
            assert row.survival(4) == fresh
        epochs.add(method.epoch)
    assert 3 < len(epochs) < 25  # the prior moved it several times, not at every draft
    kept = row.survival(4)
    row.observe(4, 0)  # its own draft, rejected: worked out at once
    assert row.survival(4)[0] < kept[0]


def decoding_states(count: int, method: str, k: int, context: Sequence[int] = (1, 2, 3)) -> list:
    """`count` decoding requests (RequestState) of `method` asking for K = k, their prompt (1, 2, 3) and their
    tokens so far `context`; built inside an event loop, which a request's output queue needs."""
    import asyncio

    from services.verifier.request_state import RequestState
    from services.verifier.sampling_params import GenerationRequest, SpeculationParams

    async def states() -> list[RequestState]:
        return [RequestState(GenerationRequest(f"r{i}", (1, 2, 3), speculation=SpeculationParams(method, k)), 0,
                             list(context), asyncio.Queue()) for i in range(count)]

    return asyncio.run(states())


def test_non_negative_least_squares_recovers_costs_and_never_goes_negative():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(40), rng.integers(1, 16, 40), rng.integers(1, 144, 40), rng.random(40)])
    truth = np.array([0.02, 0.001, 0.0008, 0.0])
    assert np.allclose(non_negative_least_squares(x, x @ truth), truth, atol=1e-9)
    y = x @ np.array([0.02, 0.0, 0.001, 0.0]) - 0.0005 * x[:, 1]  # a cost that seems to fall with rows
    assert (non_negative_least_squares(x, y) >= 0).all()


def cpu_like_cost(base=0.016, per_row=0.001, per_token=0.0009) -> StepCostModel:
    """The shape of SmolLM2-135M on 2 CPU cores: weights read once per forward, ~0.9 ms per extra token."""
    model = StepCostModel()
    for rows in (1, 4, 8, 16):
        for width in (1, 2, 5, 9):
            seconds = base + per_row * rows + per_token * rows * width
            model.observe(StepShape(rows, width, 256), seconds)
    model.fit()
    return model


def accelerator_planner(overhead_s: float = 0.002) -> tuple[SpeculationPlanner, StepCostModel]:
    """An adaptive planner that knows an accelerator's flat step (4 ms + 0.03 ms a row + 0.002 ms a token) and a
    step's overhead outside its forward: (the planner, its step costs)."""
    cost = cpu_like_cost(base=0.004, per_row=0.00003, per_token=0.000002)
    planner = SpeculationPlanner(cost, adaptive=True)
    for _ in range(200):
        planner.observe_overhead(overhead_s)
    return planner, cost


def test_the_fit_predicts_unseen_shapes_and_ignores_an_outlier():
    model = cpu_like_cost()
    assert model.predict(StepShape(12, 3, 256)) == pytest.approx(0.016 + 0.012 + 0.0009 * 36, rel=1e-6)
    usual = 0.016 + 0.008 + 0.0009 * 16
    for seconds in [usual] * 4 + [5.0, 5.0]:  # a noisy spell: two of the shape's last seven samples
        model.observe(StepShape(8, 2, 256), seconds)
    model.fit()
    assert model.predict(StepShape(8, 2, 256)) == pytest.approx(usual, rel=1e-6)


def test_no_fit_until_enough_shapes_and_then_the_full_k():
    model = StepCostModel()
    model.observe(StepShape(4, 9, 100), 0.05)
    assert not model.fitted and model.predict(StepShape(4, 1, 100)) == 0.0
    assert best_width([[0.01] * 8] * 4, 100, model) == 9  # unknown costs: behave as without adaptation


def test_one_request_keeps_long_drafts_and_a_batch_drops_poor_ones():
    cost = cpu_like_cost()
    decent = [0.6 ** j for j in range(1, 9)]
    assert best_width([decent], 256, cost) >= 4  # alone, an extra column costs ~5%
    assert best_width([decent] * 16, 256, cost) <= 3  # 16 rows pay ~1 ms each per column
    poor = [0.1 ** j for j in range(1, 9)]
    assert best_width([poor] * 8, 256, cost) == 1  # K = 0: the batch runs as without speculation
    certain = [1.0] * 8
    assert best_width([certain] * 16, 256, cost) == 9


def test_a_column_is_worth_what_all_rows_gain_from_it():
    cost = cpu_like_cost()
    one_good = [[0.95 ** j for j in range(1, 9)]] + [[]] * 7  # seven rows without a draft
    all_good = [[0.95 ** j for j in range(1, 9)]] * 8
    assert best_width(one_good, 256, cost) < best_width(all_good, 256, cost)


def test_a_row_counts_as_often_as_its_weight_says():
    cost = cpu_like_cost()
    good = [0.95 ** j for j in range(1, 9)]
    mixed = [good[:8], good[:3], good[:5]]  # rows of different caps: a column counts only the rows that reach it
    assert column_gains(mixed) == pytest.approx([sum(r[j] for r in mixed if len(r) > j) for j in range(8)])
    assert column_gains(mixed, [1.0, 0.0, 0.5]) == pytest.approx(
        [good[j] + (0.5 * good[j] if j < 5 else 0.0) for j in range(8)])
    # before drafting, rows whose proposer rarely has a draft are weighted down: a batch of them is not asked
    assert best_width([good] * 8, 256, cost, weights=[1.0] * 8) == best_width([good] * 8, 256, cost)
    assert best_width([good] * 8, 256, cost, weights=[0.02] * 8) == 1


def test_a_request_is_pulled_toward_its_methods_record_over_the_other_requests():
    """A request's drafts are in its method's counts too. Counted again as its own prior, one rejected first draft
    weighed as two: alone on its method, a request fell from 0.6 to 0.27 at position 1 instead of 0.4."""
    from services.verifier.acceptance import INITIAL_ACCEPTANCE, INITIAL_WEIGHT, METHOD_DECAY, PRIOR_WEIGHT

    alone = AcceptanceEstimate(MethodAcceptance())
    alone.observe(4, 0)
    assert alone.survival(1)[0] == pytest.approx(INITIAL_ACCEPTANCE * PRIOR_WEIGHT / (1 + PRIOR_WEIGHT))  # 0.4
    method = MethodAcceptance()
    mine, other = AcceptanceEstimate(method), AcceptanceEstimate(method)
    mine.observe(4, 4)
    other.observe(4, 0)
    mine.observe(4, 4)
    other.observe(4, 0)
    # the method forgets every count alike, this request's share of them included: left is the other's record
    others_seen = METHOD_DECAY ** 2 + 1.0
    expected = INITIAL_ACCEPTANCE * INITIAL_WEIGHT / (others_seen + INITIAL_WEIGHT)
    assert method.first_position_rate(mine.own) == pytest.approx(expected)
    assert method.first_position_rate() > expected  # the whole record has this request's accepted drafts too


def test_a_shorter_survival_read_is_a_prefix_of_the_longest_one_and_a_longer_read_extends_it():
    """The planner reads each row at its cap, then at its draft's length: both from one computation."""
    method = MethodAcceptance()
    mine = AcceptanceEstimate(method)
    mine.observe(4, 2)
    computed = []
    rate = mine.counts.rate
    mine.counts.rate = lambda *args: computed.append(args[0]) or rate(*args)
    longest = mine.survival(4)
    assert computed == [1, 2, 3, 4]
    assert mine.survival(1) == longest[:1] and mine.survival(3) == longest[:3] and mine.survival(4) is longest
    assert computed == [1, 2, 3, 4]
    longer = mine.survival(6)
    assert longer[:4] == longest and len(longer) == 6 and computed[4:] == [1, 2, 3, 4, 5, 6]
    assert mine.survival(5) == longer[:5] and len(computed) == 10


def test_a_survival_is_computed_again_whenever_its_counts_or_its_methods_change():
    method = MethodAcceptance()
    mine, other = AcceptanceEstimate(method), AcceptanceEstimate(method)
    first = mine.survival(4)
    assert mine.survival(4) == first and mine.survival(2) == first[:2]
    assert isinstance(first, tuple)  # handed out uncopied, so no caller may alter what is cached
    assert mine.survival(4) is first  # the shorter read was served from the longer one, which stays cached
    other.observe(4, 0)  # another request of the method: this one's position 1 follows the method's figure
    after_other = mine.survival(4)
    assert after_other[0] < first[0]
    mine.observe(4, 4)
    assert mine.survival(4)[3] > after_other[3]


def test_a_speculative_step_pays_its_own_bookkeeping():
    """A step that verifies drafts costs more outside its forward than a plain one (H100, 64 chats: 2.04 against
    1.57 ms); a planner that weighs widths > 1 by the plain figure asks where it loses."""
    cost = cpu_like_cost()
    fair = [[0.5 ** j for j in range(1, 5)]] * 16
    assert best_width(fair, 256, cost, overhead_s=0.005) > 1
    assert best_width(fair, 256, cost, overhead_s=0.005, speculative_overhead_s=0.005) > 1
    assert best_width(fair, 256, cost, overhead_s=0.005, speculative_overhead_s=0.060) == 1
    planner = SpeculationPlanner(cost, adaptive=True)
    for _ in range(200):
        planner.observe_overhead(0.005)
    assert planner.speculative_overhead_s(16) is None  # not seen yet: widths > 1 are weighed by the plain figure
    planner.observe_overhead(0.060, speculative=True, rows=16)  # one sample moves it from the plain figure, smoothed
    assert planner.overhead_s(16) == pytest.approx(0.005, rel=1e-3)
    assert planner.speculative_overhead_s(16) == pytest.approx(0.005 + 0.05 * 0.055, rel=1e-3)
    for _ in range(200):
        planner.observe_overhead(0.060, speculative=True, rows=16)
    assert planner.speculative_overhead_s(16) == pytest.approx(0.060, rel=1e-3)
    assert planner.overhead_s(16) == pytest.approx(0.005, rel=1e-3)
    assert planner.speculative_overhead_s(1) == pytest.approx(0.060, rel=1e-3)  # one row count seen: its figure
    # both grow with the rows (a plain step 1 ms and 0.1 ms a row, a speculative one 0.5 ms and 0.2 ms a row more),
    # learned at 16 rows, then at 1 (the figures of 16 rows are not charged to one request), predicted between
    planner = SpeculationPlanner(cost, adaptive=True)
    for rows in (16, 1):
        for _ in range(200):
            planner.observe_overhead(0.001 + 0.0001 * rows, rows=rows)
            planner.observe_overhead(0.0015 + 0.0003 * rows, speculative=True, rows=rows)
    for rows in (1, 8, 16):
        assert planner.overhead_s(rows) == pytest.approx(0.001 + 0.0001 * rows, rel=1e-3)
        assert planner.speculative_overhead_s(rows) == pytest.approx(0.0015 + 0.0003 * rows, rel=1e-3)


def test_drafts_that_push_waiting_prompts_to_a_later_step_pay_for_it():
    """Where prompts wait and the token budget binds, each draft token fed pushes a prompt token to a later step:
    64 rows that would verify drafts with a step to themselves verify fewer or none beside a backlog, and the same
    when the backlog fits beside the drafts."""
    from services.verifier.step_planning import PrefillBacklog

    planner, cost = accelerator_planner()
    decode = decoding_states(64, "ngram", 4)
    for state in decode:
        state.speculation = planner.start("ngram")
        for _ in range(20):
            state.speculation.acceptance.observe(4, 1)
            state.speculation.drafts.observe(True)
    alone = planner.draft_requests(decode, [4] * 64)
    assert max(alone) >= 1
    assert planner.draft_requests(decode, [4] * 64, PrefillBacklog(waiting=40, max_num_batched_tokens=512)) == alone
    crowded = planner.draft_requests(decode, [4] * 64, PrefillBacklog(waiting=5000, max_num_batched_tokens=512))
    assert max(crowded) < max(alone), (alone[0], crowded[0])
    drafts = [ProposedDraft([5, 6, 7, 8], None) for _ in decode]
    assert [len(d.tokens) for d in planner.choose_drafts(decode, drafts)] == [max(alone)] * 64
    chosen = planner.choose_drafts(decode, drafts, PrefillBacklog(waiting=5000, max_num_batched_tokens=512))
    assert all(len(d.tokens) < max(alone) for d in chosen)


def test_a_rejected_probe_backs_off_and_an_accepted_one_resets():
    probe = ProbeSchedule(since=3)  # started at step 3: due once more than PROBE_INTERVAL steps have passed
    assert not any(probe.due(now) for now in range(3, 4 + PROBE_INTERVAL))
    assert probe.due(4 + PROBE_INTERVAL)
    probe.verified(probed=True, num_accepted=0, now=20)
    assert probe.interval == 2 * PROBE_INTERVAL and not probe.due(20 + 2 * PROBE_INTERVAL)
    assert probe.due(21 + 2 * PROBE_INTERVAL)
    for _ in range(20):
        probe.verified(probed=True, num_accepted=0, now=30)
    assert probe.interval == PROBE_INTERVAL_MAX
    probe.verified(probed=True, num_accepted=1, now=40)
    assert probe.interval == PROBE_INTERVAL and probe.since == 40
    probe.unanswered(now=50)  # a probe without a draft backs off as a rejected one
    assert probe.interval == 2 * PROBE_INTERVAL and probe.since == 50


def test_a_probe_that_came_back_without_a_draft_backs_off_when_its_step_is_settled():
    """The engine reports only the rows that verified a draft: a probe that came back empty is settled with its step
    (settle_probe), and backs off as a rejected one does, instead of staying due and asking at every step."""
    planner, cost = accelerator_planner()
    planner.draft_cost.observe(1, 0.003)  # a call costs half a step: only probes ask
    (row,) = decoding_states(1, "ngram", 4)
    row.speculation = planner.start("ngram")
    row.speculation.asked_before = True
    for _ in range(20):
        row.speculation.acceptance.observe(4, 0)
    for _ in range(500):  # due from the first step; asked once the ration affords it
        asks = planner.draft_requests([row], [4])
        if any(asks):
            break
        planner.settle_probe(0.006)
    assert asks == [1] and row.speculation.probing
    planner.choose_drafts([row], [ProposedDraft([], None)])  # nothing came back
    planner.settle_probe(0.006)
    probe = row.speculation.probe
    assert not row.speculation.probing and probe.interval == 2 * PROBE_INTERVAL and probe.since == planner.steps
    assert not any(planner.draft_requests([row], [4]))


def test_cut_drafts_keep_their_q_rows_and_trees_their_first_nodes(monkeypatch):
    import torch

    draft = ProposedDraft([1, 2, 3], torch.eye(4)[:3])
    cut = draft.cut(2)
    assert cut.tokens == [1, 2] and cut.probs.shape == (2, 4)
    assert draft.cut(0).tokens == []
    tree = ProposedDraft([1, 2, 3], None, [-1, -1, 0])  # parents come first: any first k nodes are a tree
    assert tree.cut(2) == ProposedDraft([1, 2], None, [-1, -1])


def test_probe_columns_are_rationed_to_a_share_of_step_time():
    from services.verifier.row_speculation import PROBE_TIME_SHARE, ProbeBudget

    budget = ProbeBudget()
    step_s, column_s = 0.060, 0.015  # 16 rows on a CPU: a column costs a quarter of the step
    probes = 0
    for _ in range(10_000):
        if budget.earn(step_s, column_s):
            budget.spend(column_s)
            probes += 1
    assert probes * column_s <= PROBE_TIME_SHARE * 10_000 * step_s + column_s
    assert probes >= 0.9 * PROBE_TIME_SHARE * 10_000 * step_s / column_s  # and the share is really used


def test_a_probe_is_charged_what_its_step_really_cost():
    """Probes are rationed to PROBE_TIME_SHARE of step time. A probe's step also pays the speculative bookkeeping and
    its rows' first call on the drafter, which the prediction that granted it leaves out: settled at what the step
    really cost, probes stay within the share; charged the prediction, they took several times it."""
    from services.verifier.row_speculation import PROBE_TIME_SHARE

    def probe_share(measured: bool) -> float:
        planner, cost = accelerator_planner()
        planner.draft_cost.observe(1, 0.001)  # a call predicted at 1 ms
        decode = decoding_states(64, "ngram", 4)
        for state in decode:
            state.speculation = planner.start("ngram")
            for _ in range(20):
                state.speculation.acceptance.observe(4, 0)  # nothing accepted: width 1, rows only probe
            state.speculation.probe.interval = 0  # due at every step (a rejection doubles 0): the budget decides
        plain_s = cost.predict(StepShape(64, 1, 4)) + 0.002
        total_s = extra_s = 0.0
        for _ in range(5000):
            asks = planner.draft_requests(decode, [4] * 64)
            probed = any(asks)
            step_s = plain_s + (0.006 if probed else 0.0)  # a probe really costs 6 ms
            planner.settle_probe(step_s, measured=measured)
            for state, ask in zip(decode, asks, strict=True):
                planner.observe_row(state, ask, 0)
            total_s += step_s
            extra_s += step_s - plain_s
        return extra_s / total_s

    assert probe_share(measured=True) <= 1.2 * PROBE_TIME_SHARE
    assert probe_share(measured=False) > 2 * PROBE_TIME_SHARE


def test_an_ask_of_every_row_is_priced_at_what_such_asks_cost_not_at_what_probes_cost():
    """64 rows on an accelerator whose drafts are worth asking for at the price of a probe of two rows (0.5 ms), and
    not at what an ask of all 64 was measured to take (24 ms, three steps' time; 8-24 ms at 64 chats over gRPC): the
    planner stops asking once such an ask is measured, and it is measured at the rows it asked."""
    planner, cost = accelerator_planner()
    decode = decoding_states(64, "ngram", 4)
    for state in decode:
        state.speculation = planner.start("ngram")
        state.speculation.asked_before = True
        for _ in range(3):
            state.speculation.acceptance.observe(4, 1)  # a token accepted a draft
    planner.draft_cost.observe(1, 0.0005, rows=2)
    asks = planner.draft_requests(decode, [4] * 64)
    assert min(asks) > 0  # every row asked
    planner.observe_drafting(max(asks), 0.024)  # which took 24 ms
    assert planner.draft_cost.predict(max(asks), 64) == pytest.approx(0.024)
    assert planner.draft_cost.predict(1, 2) == pytest.approx(0.0005)  # the probes' figure stands
    assert not any(planner.draft_requests(decode, [4] * 64))


def one_eagle_row_on_an_accelerator():
    """A planner that knows an accelerator's step at one row (2.4 ms), 0.2 ms of overhead and asks of 1 ms, and one
    EAGLE request already opened on its drafter: (planner, the request, a plain step's seconds)."""
    cost = cpu_like_cost(base=0.0024, per_row=0.0, per_token=0.00003)
    planner = SpeculationPlanner(cost, adaptive=True)
    for _ in range(200):
        planner.observe_overhead(0.0002)
    planner.draft_cost.observe(1, 0.001)
    (row,) = decoding_states(1, "eagle", 4)
    row.speculation = planner.start("eagle")
    row.speculation.asked_before = True
    return planner, row, cost.predict(StepShape(1, 1, 4)) + 0.0002


def only_probes_ask(row) -> None:
    """The row's estimate too low to ask (five drafts of 4, all rejected) and a probe due at every step: whether it
    probes is the budget's to decide."""
    collapsed = AcceptanceEstimate(MethodAcceptance())
    for _ in range(5):
        collapsed.observe(4, 0)
    row.speculation.acceptance = collapsed
    row.speculation.probe.interval = 0  # a rejection doubles 0


def test_probes_that_win_their_tokens_pay_for_themselves():
    """The probe ration bounds what probing loses, net of the tokens probes win. One request alone with a cheap
    drafter: a probe's call costs less than the step its accepted token saves, so probes that land are not rationed,
    while probes that are rejected keep to PROBE_TIME_SHARE of step time."""
    from services.verifier.row_speculation import PROBE_TIME_SHARE

    def probes(lands: bool) -> tuple[int, float]:
        planner, row, plain_s = one_eagle_row_on_an_accelerator()
        count, lost_s = 0, 0.0
        for _ in range(2000):
            only_probes_ask(row)
            asks = planner.draft_requests([row], [4])
            step_s = plain_s + (0.0011 if asks[0] else 0.0)
            accepted = int(lands and asks[0] > 0)
            planner.observe_row(row, asks[0], accepted)
            planner.settle_probe(step_s)
            count += asks[0] > 0
            lost_s += step_s - plain_s - accepted * plain_s  # a token won is a step saved
        return count, lost_s / (2000 * plain_s)

    landing, _ = probes(lands=True)
    rejected, lost_share = probes(lands=False)
    assert landing > 0.9 * 2000  # each one pays for the next
    assert 0 < lost_share <= 1.2 * PROBE_TIME_SHARE and rejected < 0.1 * landing


def test_a_probe_that_was_never_observed_is_not_taken_for_one_in_the_next_step():
    """A plain step touches only the rows it probes (at 64 rows, setting every row's flags was about half a plain
    step's plan); a probing step whose rows were never observed (the step failed) leaves no flag behind: the next
    step's outcome is not counted as a probe's."""
    planner, row, _ = one_eagle_row_on_an_accelerator()
    only_probes_ask(row)
    planner.probes.credit_s = 1.0  # a probe is affordable
    assert planner.draft_requests([row], [4]) == [1] and row.speculation.probing
    row.speculation.probe.interval = 10**9  # no more probes due; the step above is never observed
    assert planner.draft_requests([row], [4]) == [0] and not row.speculation.probing
    planner.observe_row(row, 1, 0)  # a draft verified and rejected: not a probe, so the interval stands
    assert row.speculation.probe.interval == 10**9


def test_a_drafting_figure_left_high_by_a_pause_is_probed_again_soon():
    """A drafting call that took 200 ms once (a pause) stops the asking. Its figure fades slowly (draft_cost.py), so
    it is the probes that measure it again: granted at no more than a plain step's cost, they come within a few
    hundred steps, and once the figure is stale a probe's measurement replaces it. Probes before that are averaged
    in without renewing the figure's age: renewing it, they kept the figure from going stale and averaged it down a
    fifth at a time."""
    from services.verifier.draft_cost import STALE_STEPS

    planner, cost = accelerator_planner(overhead_s=0.001)
    planner.draft_cost.observe(1, 0.200, rows=4)  # a call asking the four rows the probes below ask
    decode = decoding_states(4, "ngram", 4)
    for state in decode:
        state.speculation = planner.start("ngram")
        state.speculation.asked_before = True
    plain_s = cost.predict(StepShape(4, 1, 4)) + 0.001
    probes = []
    for step in range(1, 2000):
        asks = planner.draft_requests(decode, [4] * 4)
        if any(asks):
            probes.append(step)
        planner.observe_drafting(max(asks), 0.0005 if any(asks) else 0.0)  # a probe's call: 0.5 ms
        if planner.draft_cost.predict(1, 4) == pytest.approx(0.0005, rel=0.01):
            break
        planner.settle_probe(plain_s)
        for state in decode:
            planner.observe_row(state, 0, 0)  # no draft came back
    assert STALE_STEPS <= step <= 2 * STALE_STEPS, (step, probes)  # renewed by every probe: 285


def test_one_probing_step_that_took_far_longer_than_a_probe_costs_does_not_silence_probing():
    """A probing step that took 100 plain steps (a graph captured inside its drafting call, a pause) is charged at
    most PROBE_CHARGE_STEPS plain steps: probes, rejected ones too, come again within a few hundred steps, where the
    whole 100 steps charged at PROBE_TIME_SHARE would take 10,000."""
    from services.verifier.row_speculation import PROBE_CHARGE_STEPS, PROBE_TIME_SHARE

    planner, row, plain_s = one_eagle_row_on_an_accelerator()
    probes = []
    for step in range(3000):
        only_probes_ask(row)
        asks = planner.draft_requests([row], [4])
        if asks[0]:
            probes.append(step)
        planner.observe_row(row, asks[0], 0)
        planner.settle_probe(100 * plain_s if probes == [step] else plain_s)
    assert len(probes) >= 2, probes
    assert probes[1] - probes[0] <= 1.5 * PROBE_CHARGE_STEPS / PROBE_TIME_SHARE, probes[:3]


def test_tree_rows_are_asked_for_the_nodes_the_plan_after_drafting_keeps():
    """A tree of k tokens spends some on siblings, which add less than k chain positions (tree_budget.py). Valued as
    a chain before drafting, 16 tree rows were asked for about 3 tokens each of which the plan after drafting kept
    none (on an H200: 841 rows asked for EAGLE-3 trees at 8 chats, 144 verified); valued by what their trees' j-th
    best nodes were worth, they are asked for what is then verified."""
    from services.common.token_trees import tree_depths

    def likeliest_nodes(k: int) -> ProposedDraft:
        """The k likeliest nodes of a tree whose roots have probabilities 0.45, 0.2, 0.1 and 0.05 and whose nodes'
        two children have half and a sixth of their parent's (as EAGLE-2 trees are chosen)."""
        chosen, frontier = [], [(p, -1) for p in (0.45, 0.2, 0.1, 0.05)]
        while len(chosen) < k:
            frontier.sort(key=lambda node: -node[0])
            probability, parent = frontier.pop(0)
            chosen.append((probability, parent))
            frontier += [(probability / 2, len(chosen) - 1), (probability / 6, len(chosen) - 1)]
        return ProposedDraft(list(range(1, k + 1)), None, [p for _, p in chosen], [q for q, _ in chosen])

    planner = SpeculationPlanner(cpu_like_cost(base=0.004, per_row=0.00003, per_token=0.001), adaptive=True)
    for _ in range(200):
        planner.observe_overhead(0.001)
    for k in (1, 2, 4, 8, 16, 24):
        planner.draft_cost.observe(k, 0.0005 + 0.00005 * k)
    decode = decoding_states(16, "eagle", 24, [1, 2, 3] * 100)
    for state in decode:
        state.speculation = planner.start("eagle")
        state.speculation.asked_before = True
    asked = kept = 0
    for step in range(200):
        asks = planner.draft_requests(decode, [24] * len(decode))
        chosen = planner.choose_drafts(decode, [likeliest_nodes(k) if k else ProposedDraft([], None) for k in asks])
        asked, kept = asked + sum(asks), kept + sum(len(draft.tokens) for draft in chosen)
        for state, draft in zip(decode, chosen, strict=True):
            depth = 1 + max(tree_depths(draft.parents or []), default=-1)
            planner.observe_row(state, depth, min(depth, 2 if step % 3 == 0 else 1))
    assert kept > 1000 and kept >= 0.9 * asked, (asked, kept)
