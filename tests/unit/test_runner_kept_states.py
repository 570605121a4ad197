"""States a request leaves in the runner (runner_kept_states.py): read onto the host only when something reads
them, each position once, in one call a runner for the rows of an ask; read before the slot goes at a preemption,
so that a request without its slot never reaches the runner; other runners keep them on the host as before."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
import torch

from services.verifier.kept_states import KeptStates, StepStates
from services.verifier.runner_kept_states import RunnerKeptStates, catch_up, kept_states_for

WIDTH = 3


class StoringRunner:
    """A runner keeping each sequence's states, the state of position p being p in every column (in bfloat16)."""

    caches_hidden_states = True

    def __init__(self) -> None:
        self.lengths: dict[Hashable, int] = {}
        self.reads: list[list[tuple[Hashable, int, int]]] = []

    def length(self, seq_id: Hashable) -> int:
        return self.lengths[seq_id]  # KeyError for a sequence without a slot, as the real runners

    def kept_hidden_states_of(self, ranges: Sequence[tuple[Hashable, int, int]]) -> torch.Tensor:
        self.reads.append(list(ranges))
        for seq_id, _, stop in ranges:
            assert stop <= self.lengths[seq_id]
        positions = [p for _, start, stop in ranges for p in range(start, stop)]
        return torch.tensor(positions, dtype=torch.bfloat16)[:, None].expand(-1, WIDTH).contiguous()


def positions_of(states: torch.Tensor | None) -> list[float]:
    assert states is not None and states.dtype == torch.bfloat16 and states.shape[1] == WIDTH
    return states[:, 0].float().tolist()


def attached(runner: StoringRunner, seq_id: str, length: int) -> RunnerKeptStates:
    runner.lengths[seq_id] = length
    states = kept_states_for(runner, seq_id)
    assert isinstance(states, RunnerKeptStates)
    states.attach()
    return states


def test_an_ask_reads_its_rows_unread_positions_in_one_call_and_each_position_once():
    runner = StoringRunner()
    a, b, c = (attached(runner, name, length) for name, length in (("a", 5), ("b", 0), ("c", 3)))
    assert positions_of(a.view()) == [0, 1, 2, 3, 4]  # a read of its own
    runner.lengths.update(a=7, b=2, c=4)
    assert (len(a), len(b), len(c)) == (7, 2, 4)
    catch_up([a, None, b, c])
    assert runner.reads == [[("a", 0, 5)], [("a", 5, 7), ("b", 0, 2), ("c", 0, 4)]]
    catch_up([a, b, c])
    assert positions_of(a.view()) == list(range(7)) and positions_of(b.view()) == [0, 1]
    assert positions_of(c.view()) == [0, 1, 2, 3]
    assert len(runner.reads) == 2  # nothing unread: no call


def test_a_preempted_request_reads_first_and_then_never_reaches_the_runner_until_it_holds_a_slot_again():
    runner = StoringRunner()
    states = attached(runner, "a", 6)
    positions_of(states.view())
    runner.lengths["a"] = 9
    states.detach()  # the slot is about to go: positions 6..8 read now
    del runner.lengths["a"]
    assert len(states) == 9 and positions_of(states.view()) == list(range(9))
    runner.lengths["a"] = 4  # resumed: its positions computed again, in part so far
    states.attach()
    assert len(states) == 9 and positions_of(states.view()) == list(range(9))
    runner.lengths["a"] = 11
    assert positions_of(states.view()) == list(range(11))
    assert runner.reads == [[("a", 0, 6)], [("a", 6, 9)], [("a", 9, 11)]]
    cleared = states.cleared()
    assert isinstance(cleared, RunnerKeptStates) and len(cleared) == 0 and cleared.view() is None


@pytest.mark.parametrize("runner", [object(), type("NoStore", (), {"caches_hidden_states": False,
                                                                    "kept_hidden_states_of": None})()])
def test_runners_that_keep_no_states_keep_them_on_the_host_from_each_step(runner):
    states = kept_states_for(runner, "a")
    assert type(states) is KeptStates and states.fed_by_steps
    assert not RunnerKeptStates(StoringRunner(), "a").fed_by_steps


def test_a_drafting_row_that_has_read_everything_takes_the_steps_states_and_reads_only_past_them():
    """A row that verifies a draft is likely asked again at the next step: its step hands it the states (queued
    behind the step's work) instead of a read of its own at that ask. Only once it has read every position before
    the step (the step's rows follow on), and only while it holds its slot."""
    runner = StoringRunner()
    states = attached(runner, "a", 4)
    assert not states.takes_step_states(drafting=True)  # positions 0..3 unread: the ask reads them with the rest
    assert not states.takes_step_states(drafting=False)
    positions_of(states.view())
    assert states.takes_step_states(drafting=True) and not states.takes_step_states(drafting=False)
    step = StepStates(torch.tensor([[4.0] * WIDTH, [5.0] * WIDTH, [9.0] * WIDTH], dtype=torch.bfloat16)[None])
    states.append(step.row(0, slice(0, 2)))  # the step fed 4, 5 (and a rejected draft), kept two
    runner.lengths["a"] = 8  # three more steps that drafted nothing: left in the runner
    assert positions_of(states.view()) == list(range(8))
    assert runner.reads == [[("a", 0, 4)], [("a", 6, 8)]]
    states.detach()
    assert not states.takes_step_states(drafting=True)
    assert KeptStates().takes_step_states(drafting=False)  # a step is its only source
