"""The rows' figures a plan reads, kept from step to step while unchanged (plan_rows.py): reused when nothing they
depend on changed, read again when something did, and never stale in the planner's plans."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.verifier.draft_collection import ProposedDraft
from services.verifier.plan_rows import PlanRows
from services.verifier.request_state import RequestState
from services.verifier.row_speculation import ProbeSchedule
from services.verifier.sampling_params import GenerationRequest, SpeculationParams
from services.verifier.speculation_planner import SpeculationPlanner
from tests.step_costs import FixedCost


def test_figures_are_read_again_only_when_what_they_depend_on_changed():
    reads = []

    def survival(state, cap):
        reads.append(state)
        return (state.accept,) * cap

    def row(accept: float) -> SimpleNamespace:
        return SimpleNamespace(accept=accept, speculation=SimpleNamespace(drafts=SimpleNamespace(rate=1.0),
                                                                          probe=ProbeSchedule(), asked_before=True))

    rows = [row(0.5), row(0.5), row(1.0)]
    figures = PlanRows()
    figures.read(rows, [2, 2, 1], survival)
    assert len(reads) == 3 and figures.columns == pytest.approx([2.0, 1.0])
    assert figures.first_wins == pytest.approx([0.5, 0.5, 1.0])
    figures.read(list(rows), [2, 2, 1], survival)  # the same rows (a new list) at the same caps: kept
    assert len(reads) == 3
    rows[0].speculation.drafts.rate = 0.0  # its proposer came back empty
    figures.changed()
    figures.read(rows, [2, 2, 1], survival)
    assert len(reads) == 6 and figures.columns == pytest.approx([1.5, 0.5]) and figures.draft_rates[0] == 0.0
    assert figures.first_wins == pytest.approx([0.0, 0.5, 1.0])
    figures.read(rows, [2, 2, 2], survival)  # a cap changed
    assert len(reads) == 9 and figures.columns == pytest.approx([1.5, 1.5])
    figures.read([rows[0], rows[1], row(1.0)], [2, 2, 2], survival)  # another row in the same place
    assert len(reads) == 12
    figures.read(rows[:2], [2, 2], survival)  # a row left
    assert len(reads) == 14 and figures.columns == pytest.approx([0.5, 0.5])


def decoding_rows(planner: SpeculationPlanner, count: int) -> list[RequestState]:
    async def make() -> list[RequestState]:
        return [RequestState(GenerationRequest(f"r{i}", (1, 2, 3), speculation=SpeculationParams("eagle", 4)), 0,
                             [1, 2, 3], asyncio.Queue()) for i in range(count)]

    states = asyncio.run(make())
    for state in states:
        state.speculation = planner.start("eagle")
    return states


def test_the_plan_reads_each_empty_answer_and_each_verified_draft():
    """Whatever the planner observes between two plans reaches the second: the figures of the first are not
    reused after a row's draft rate or acceptance moved."""
    planner = SpeculationPlanner(FixedCost(base=0.004, per_row=0.00003, per_token=0.000002), adaptive=True)
    decode = decoding_rows(planner, 8)
    assert planner.draft_requests(decode, [4] * 8) == [4] * 8  # nothing known yet: every row asked
    first = planner.row_figures.survivals
    planner.choose_drafts(decode, [ProposedDraft([], None)] * 8)  # every proposer came back empty
    for state in decode:
        planner.observe_row(state, 0, 0)
    planner.draft_requests(decode, [4] * 8)
    assert planner.row_figures.draft_rates == [s.speculation.drafts.rate for s in decode]
    assert max(planner.row_figures.draft_rates) < 1.0
    for _ in range(40):  # then every draft rejected at its first token
        asks = planner.draft_requests(decode, [4] * 8)
        planner.choose_drafts(decode, [ProposedDraft([7] * ask, None) for ask in asks])
        for state, ask in zip(decode, asks, strict=True):
            planner.observe_row(state, ask, 0)
        planner.draft_requests(decode, [4] * 8)
        assert planner.row_figures.survivals == [s.speculation.acceptance.survival(4) for s in decode]
    assert all(now[0] < 0.5 * then[0] for now, then in zip(planner.row_figures.survivals, first, strict=True))


def test_the_rows_due_for_a_re_probe_are_read_from_every_schedule_as_it_moves():
    """The plan finds the rows due for a re-probe from the figures' order of due steps, not by looking at every row:
    at each step of a batch whose drafts are worth nothing, probed, answered empty, rejected or accepted in turn,
    they are exactly the rows whose own schedule says due."""
    planner = SpeculationPlanner(FixedCost(base=0.004, per_row=0.00003, per_token=0.0004), adaptive=True)
    decode = decoding_rows(planner, 12)
    probed = 0
    for step in range(400):
        caps = [0 if (i + step // 50) % 5 == 0 else 4 for i in range(len(decode))]  # some rows may not draft
        asks = planner.draft_requests(decode, caps)
        expected = [i for i, (state, cap) in enumerate(zip(decode, caps, strict=True))
                    if cap > 0 and state.speculation.probe.due(planner.steps)]
        assert sorted(planner.row_figures.due(planner.steps)) == expected
        drafts = [ProposedDraft([7] * ask if (i + step) % 3 else [], None) for i, ask in enumerate(asks)]
        drafts = planner.choose_drafts(decode, drafts)
        probed += sum(map(bool, asks))
        for i, (state, draft) in enumerate(zip(decode, drafts, strict=True)):
            planner.observe_row(state, len(draft.tokens), len(draft.tokens) if (i + step) % 4 == 0 else 0)
        planner.settle_probe(0.005)
    assert probed > 20  # the schedules moved: rows were probed, answered empty, rejected and accepted
