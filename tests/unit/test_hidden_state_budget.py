"""HiddenStateBudget: how far each sequence's backlog of states goes in one Draft step."""

from services.verifier.hidden_state_budget import HiddenStateBudget


def test_backlogs_that_fit_go_whole_and_the_one_that_does_not_goes_in_part():
    budget = HiddenStateBudget(bytes_left=10 * 4 * 2)  # ten rows of four float16 values
    assert budget.take(held=0, committed=7, width=4) == 7  # six rows (states for all but the last token)
    assert budget.take(held=7, committed=9, width=4) == 9  # rows 6..7
    assert budget.take(held=0, committed=30, width=4) == 3  # the two rows left: tokens 0..2, states of 0..1
    assert budget.take(held=0, committed=30, width=4) == 1  # nothing left: its first token, no row
    assert budget.take(held=12, committed=12, width=4) == 12  # nothing missing


def test_the_steps_first_backlog_always_moves_so_every_backlog_drains():
    held, steps = 0, 0
    while held < 100:
        held = HiddenStateBudget(bytes_left=3).take(held, 100, width=4)  # a budget under one row
        steps += 1
    assert steps == 99  # the 99 rows (all but the last token's), one a step


def test_a_partial_backlog_resumes_where_it_stopped():
    held = HiddenStateBudget(bytes_left=5 * 2).take(0, 20, width=1)
    assert held == 6  # rows 0..4
    assert HiddenStateBudget(bytes_left=5 * 2).take(held, 20, width=1) == 11  # rows 5..9
