"""A request's target states left where the forward wrote them, in the runner's own store beside their K/V, and
brought to the host only when something reads them: its EAGLE drafter when the planner asks it, an extraction when
the request ends.

KeptStates has every step hand each such row the states it committed. At 64 rows of the simulated H200 step
(engine_host_cost, eagle-sim) that cost about 0.3 ms of host work a step beside a step of about 5.5 ms: the states'
copy to the host, a view and an append a row, and each request's copy of its views every 128 steps. It is paid at
every step, though under load the planner asks EAGLE at a few steps in a hundred. A runner that keeps every
position's states for its prefix cache (llama_runner.keep_hidden_states) already holds them on the device. With it,
a step hands states only to the rows that verify a draft in it (`takes_step_states`: likely asked again at the next
step), and an ask reads, for the rows it asks, the positions each has not read yet, in one gather and one copy
(catch_up).

On the host a request holds the states it has read; the runner holds the rest, positions [read, length), where
length is the sequence's length in the runner: every committed token the target has run on, as KeptStates counts.
The forward writes every fed position's states, and truncate or keep_path leaves the committed ones in place.
While the request holds no slot (waiting, or preempted: `detach` reads what is left first), only the host's are
there. A request resumed after a preemption computes its positions again; those it read already are not read again.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

import torch

from services.verifier.kept_states import KeptStates


class StateKeepingRunner(Protocol):
    """What of a runner (llama_runner.LlamaFamilyRunner) a request's states kept there need: a runner whose
    `caches_hidden_states` is true has both."""

    def length(self, seq_id: Hashable) -> int: ...

    def kept_hidden_states_of(self, ranges: Sequence[tuple[Hashable, int, int]]) -> torch.Tensor:
        """[sum of the ranges' lengths, H] on the host: each (sequence, start, stop) range's kept states."""


def keeps_states(runner: object) -> bool:
    """The runner keeps every position's states itself (`caches_hidden_states`: beside their K/V, for its prefix
    cache) and hands them out in ranges (StateKeepingRunner)."""
    return bool(getattr(runner, "caches_hidden_states", False))


def kept_states_for(runner: object, seq_id: Hashable) -> KeptStates:
    """A new request's kept states: in the runner where it keeps them, on the host from each step otherwise."""
    return RunnerKeptStates(runner, seq_id) if keeps_states(runner) else KeptStates()


class RunnerKeptStates(KeptStates):
    """A request's states [n, H]: those read so far on the host, the rest in the runner until read."""

    fed_by_steps = False  # the forward has written them in the runner: steps need hand it nothing

    def __init__(self, runner: StateKeepingRunner, seq_id: Hashable) -> None:
        super().__init__()
        self.runner = runner
        self.seq_id = seq_id
        self._attached = False  # the sequence holds its slot in the runner

    def __len__(self) -> int:
        return max(super().__len__(), self.runner.length(self.seq_id) if self._attached else 0)

    def takes_step_states(self, drafting: bool) -> bool:
        """Only while its row drafts, and once it has read every position before the step. Its drafter is then likely
        asked at the next step too, and the step's own copy (queued behind the step's work) brings what that ask
        would otherwise read with a gather and a wait of its own: a request alone, asked at every step, would pay
        that wait at every step. A step whose row does not draft leaves the states in the runner."""
        return drafting and self._attached and super().__len__() == self.runner.length(self.seq_id)

    def cleared(self) -> KeptStates:
        return RunnerKeptStates(self.runner, self.seq_id)

    def attach(self) -> None:
        self._attached = True

    def detach(self) -> None:
        """Read what the runner still holds: the slot, and the states with it, are about to be given back."""
        catch_up([self])
        self._attached = False

    def unread(self) -> tuple[Hashable, int, int] | None:
        """The positions the runner holds that the host has not read, as a (sequence, start, stop) range."""
        read = super().__len__()
        length = self.runner.length(self.seq_id) if self._attached else read
        return (self.seq_id, read, length) if length > read else None

    def view(self) -> torch.Tensor | None:
        catch_up([self])
        return super().view()


def catch_up(kept: Iterable[KeptStates | None]) -> None:
    """Read onto the host the states that the runner holds of these requests and they have not read yet, in one
    gather and one copy a runner (for the rows of one ask, before their drafter reads them)."""
    behind: dict[int, list[tuple[RunnerKeptStates, tuple[Hashable, int, int]]]] = {}
    for states in kept:
        if isinstance(states, RunnerKeptStates) and (unread := states.unread()) is not None:
            behind.setdefault(id(states.runner), []).append((states, unread))
    for group in behind.values():
        ranges = [unread for _, unread in group]
        read = group[0][0].runner.kept_hidden_states_of(ranges)
        for (states, _), part in zip(group, read.split([stop - start for _, start, stop in ranges]), strict=True):
            states.append(part)
