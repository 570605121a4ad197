"""A plain plan that stands for the next steps (quiet_plan.py): over the same rows, while nothing it weighed changed,
for at most QUIET_STEPS steps; never past a row that joined or whose cap grew, a changed figure, or a row due for a
re-probe; and through the planner, a step it stands for asks nothing and costs the plan nothing, while probes and
asking come as without it."""

from __future__ import annotations

import pytest

import services.verifier.quiet_plan as quiet_plan
from services.verifier.draft_collection import ProposedDraft
from services.verifier.quiet_plan import QUIET_STEPS, QuietPlan
from services.verifier.speculation_planner import SpeculationPlanner
from tests.step_costs import FixedCost
from tests.unit.test_plan_rows import decoding_rows

CAPS = [4, 4, 4, 2]


def test_it_stands_over_the_same_rows_for_its_steps_and_no_longer():
    planner = SpeculationPlanner(FixedCost(), adaptive=True)
    decode = decoding_rows(planner, 4)
    plan = QuietPlan.of(decode, CAPS, version=7, plain_s=0.005, probe_s=0.001)
    for _ in range(QUIET_STEPS - 1):
        assert plan.stands(decode, CAPS, 7, probe_grantable=False)
    assert not plan.stands(decode, CAPS, 7, probe_grantable=False)


@pytest.mark.parametrize("change", ["a row joined", "a cap grew", "a figure changed", "a probe is due"])
def test_it_does_not_stand_past_a_change(change):
    planner = SpeculationPlanner(FixedCost(), adaptive=True)
    decode = decoding_rows(planner, 5)
    plan = QuietPlan.of(decode[:4], CAPS, version=7, plain_s=0.005, probe_s=0.001)
    rows, caps, version, due = decode[:4], list(CAPS), 7, False
    if change == "a row joined":
        rows, caps = decode, [*CAPS, 0]  # even one that cannot draft yet: the full plan reads it
    elif change == "a cap grew":
        caps[3] = 3
    elif change == "a figure changed":
        version = 8
    else:
        due = True
    assert not plan.stands(rows, caps, version, due)


def test_rows_that_left_and_caps_that_shrank_leave_it_standing():
    planner = SpeculationPlanner(FixedCost(), adaptive=True)
    decode = decoding_rows(planner, 4)
    plan = QuietPlan.of(decode, CAPS, version=7, plain_s=0.005, probe_s=0.001)
    assert plan.stands([decode[0], decode[2]], [4, 1], 7, probe_grantable=False)


def run_batch(planner: SpeculationPlanner, steps: int, accept_every: int) -> tuple[list[list[int]], int]:
    """`steps` steps of 12 EAGLE rows whose drafts are accepted whole at every `accept_every`-th row and step and
    rejected otherwise, driven as the engine drives the planner: each step's asks, and how many plans read their
    rows' figures."""
    decode = decoding_rows(planner, 12)
    reads = 0
    read = planner.row_figures.read

    def counted(*args):
        nonlocal reads
        reads += 1
        return read(*args)

    planner.row_figures.read = counted
    history = []
    for step in range(steps):
        asks = planner.draft_requests(decode, [4] * 12)
        history.append(asks)
        drafts = planner.choose_drafts(decode, [ProposedDraft([7] * ask, None) for ask in asks])
        for i, (state, draft) in enumerate(zip(decode, drafts, strict=True)):
            accepted = len(draft.tokens) if (i + step) % accept_every == 0 else 0
            planner.observe_row(state, len(draft.tokens), accepted)
        planner.settle_probe(0.005)
    return history, reads


def test_through_the_planner_quiet_steps_ask_nothing_and_skip_the_plan(monkeypatch):
    """A batch whose drafts are worth nothing on a step whose columns are dear: most steps are plain, and of those
    most skip reading their rows' figures; probes go on (the credit accrues in the quiet steps), and a
    probe's outcome is read at the next step. Without quiet plans (QUIET_STEPS 1) every plan reads them, and the
    probes come at the very same steps."""
    dear_columns = dict(base=0.004, per_row=0.00003, per_token=0.0004)
    with_quiet, reads = run_batch(SpeculationPlanner(FixedCost(**dear_columns), adaptive=True), 600, accept_every=7)
    monkeypatch.setattr(quiet_plan, "QUIET_STEPS", 1)
    without, reads_without = run_batch(SpeculationPlanner(FixedCost(**dear_columns), adaptive=True), 600,
                                       accept_every=7)
    plain = sum(not any(asks) for asks in with_quiet)
    assert plain > 400 and reads_without == 600
    assert reads < 0.45 * reads_without  # (each probe's outcome breaks a quiet run: a full plan reads it)
    probe_steps = [step for step, asks in enumerate(with_quiet) if any(asks)]
    assert len(probe_steps) > 20  # the same steps probe, the same rows: the credit is the same at every step
    assert probe_steps == [step for step, asks in enumerate(without) if any(asks)]
    assert [with_quiet[step] for step in probe_steps] == [without[step] for step in probe_steps]
    assert all(max(asks) <= 1 for asks in with_quiet)  # plain steps and probes only: asking never pays here
