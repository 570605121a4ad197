"""The first plans' predictions against their steps' outcomes, by kind of step (plan_audit.py): summed as the
planner plans, the rows commit and the engine settles each step, and decode-only steps alone."""

from __future__ import annotations

import pytest

from services.verifier.draft_collection import ProposedDraft
from services.verifier.plan_audit import PlanAudit
from services.verifier.speculation_planner import SpeculationPlanner
from tests.step_costs import FixedCost
from tests.unit.test_plan_rows import decoding_rows


def test_each_kind_sums_what_was_predicted_and_what_came():
    audit = PlanAudit()
    audit.planned("asked", rows=4, predicted_tokens=6.0, predicted_s=0.010)
    audit.accepted(1)
    audit.accepted(2)
    audit.settled(0.012, measured=True)
    audit.planned("plain", rows=4, predicted_tokens=4.0, predicted_s=0.008)
    audit.settled(0.008, measured=True)
    audit.planned("asked", rows=4, predicted_tokens=9.0, predicted_s=0.010)
    audit.accepted(5)
    audit.settled(0.030, measured=False)  # it prefilled too: not counted
    audit.accepted(3)  # nothing under way: ignored
    audit.settled(0.001, measured=True)
    asked, plain = audit.kinds["asked"], audit.kinds["plain"]
    assert (asked.steps, asked.predicted_tokens, asked.realized_tokens) == (1, 6.0, 7)
    assert (asked.predicted_s, asked.realized_s) == pytest.approx((0.010, 0.012))
    assert (plain.steps, plain.realized_tokens, plain.realized_s) == (1, 4, pytest.approx(0.008))
    assert audit.describe().startswith("asked 1 steps, tokens 7.0 (1.17x predicted), ms 12.00 (1.20x), tokens a ms 0.583 (predicted 0.6)")
    audit.reset()
    assert audit.describe() == "no decode-only step planned"


def step(planner: SpeculationPlanner, decode, accept: bool, seconds: float = 0.02) -> int:
    """One step: planned, drafted (every row asked answers), verified (all accepted or none) and settled; returns
    the tokens committed."""
    asks = planner.draft_requests(decode, [4] * len(decode))
    drafts = planner.choose_drafts(decode, [ProposedDraft([7] * ask, None) for ask in asks])
    accepted = [len(draft.tokens) if accept else 0 for draft in drafts]
    for state, draft, count in zip(decode, drafts, accepted, strict=True):
        planner.observe_row(state, len(draft.tokens), count)
    planner.settle_probe(seconds)
    return len(decode) + sum(accepted)


def test_the_planner_audits_its_steps_by_kind_as_it_planned_them():
    """Drafts always accepted: the planner asks, and its asked steps' tokens are the rows' and their drafts'. Then
    always rejected: it stops asking, and its steps are plain, or probe now and then."""
    planner = SpeculationPlanner(FixedCost(), adaptive=True)
    decode = decoding_rows(planner, 4)
    committed = sum(step(planner, decode, accept=True) for _ in range(30))
    asked = planner.audit.kinds["asked"]
    assert asked.steps == 30 and asked.realized_tokens == committed > 30 * 4 * 4
    assert 0.5 < asked.realized_tokens / asked.predicted_tokens < 1.5  # (4 rows + what 4 columns were expected to add)
    planner.audit.reset()
    for _ in range(300):
        step(planner, decode, accept=False)
    kinds = planner.audit.kinds
    assert kinds["plain"].steps > 200 and kinds["plain"].realized_tokens == 4 * kinds["plain"].steps
    assert kinds["plain"].predicted_tokens == kinds["plain"].realized_tokens
    assert sum(totals.steps for totals in kinds.values()) == 300
    assert kinds["probed"].steps > 0 and kinds["probed"].realized_tokens == 4 * kinds["probed"].steps
