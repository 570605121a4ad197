"""Pipelined drafting for model drafters: draft step t+1 while the verifier verifies step t.

Right after answering a call with draft d1..dK, the drafter goes on, on the guess that the verifier accepts the
whole draft: it feeds dK, takes its own argmax g as the guessed bonus token, and drafts e1..eK after it. That is
the draft it would give for the committed tokens `base` = committed + d1..dK + g. When the next call comes:

- its committed tokens equal `base` (the guess held): e1..eK is answered at once, its forwards already done while
  the verifier verified (they ran on the drafter's own device or cores);
- otherwise the pre-draft is dropped and the call drafts as always. The tokens the pre-draft fed stay in the
  sequence's slot as long as they are a prefix of the committed tokens, so even a rejected bonus guess loses only
  what came after it.

A pre-draft is answered only for exactly its base, so it is the very draft a fresh call would compute (argmax
chains are deterministic): pipelining never changes a draft, only when it is ready, and losslessness does not
depend on the guess. A call that arrives while a pre-draft still runs stops it after its current forward.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from services.common.proposer import DraftInput

logger = logging.getLogger(__name__)


def default_pipelining(device_type: str) -> tuple[bool, str]:
    """A draft model's pipelining where the config leaves it unset, and why: on where it measured faster.

    Pre-drafting pays when it runs beside the verifier rather than in its place: with the Qwen2.5-Coder 1.5B/0.5B
    pair (services/bench/draft_pipelining.py) the drafter on a CPU of its own was faster pipelined, sharing the
    verifier's CPUs it was slower. So: on for a draft model on an accelerator, or on a CPU set narrower than the
    machine's (`specserve serve --drafter-cpus`, taskset, a container's cpuset); off on every CPU of the machine.
    EAGLE's pre-drafts measured slower in both placements, so it does not use this (off unless asked)."""
    if device_type != "cpu":
        return True, f"the draft model runs on {device_type}"
    machine = os.cpu_count() or 0
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    if mine < machine:
        return True, f"the drafter has {mine} of the machine's {machine} CPUs to itself"
    return False, "the drafter shares the machine's CPUs with the verifier"


def wants_predraft(item: DraftInput, default: bool) -> bool:
    """The request's draft_pipelining where it set one, else the drafter's setting."""
    return default if item.pipelining is None else item.pipelining


@dataclass(frozen=True)
class PreDraft:
    base: np.ndarray  # the committed tokens it drafts after: committed + draft + guessed bonus
    tokens: tuple[int, ...]
    seconds: float  # its share of the pre-draft's time (hidden from the verifier's step when used)


@dataclass
class PipelineCounts:
    """Pre-drafts answered (their guess held), dropped (it did not, or they were stopped), and the drafting
    seconds the used ones took off the verifier's critical path."""

    used: int = 0
    discarded: int = 0
    hidden_seconds: float = 0.0


@dataclass
class PreDrafts:
    """The finished pre-drafts, one per sequence at most, and their counts."""

    counts: PipelineCounts = field(default_factory=PipelineCounts)
    _by_seq: dict[Hashable, PreDraft] = field(default_factory=dict)

    def keep(self, seq_id: Hashable, predraft: PreDraft) -> None:
        if self._by_seq.pop(seq_id, None) is not None:
            self.counts.discarded += 1
        self._by_seq[seq_id] = predraft

    def take(self, seq_id: Hashable, committed: Sequence[int], k: int) -> tuple[int, ...] | None:
        """The draft for `committed` if a pre-draft was made for exactly these tokens (at most k of its tokens);
        None otherwise. Either way the sequence's pre-draft is gone afterwards."""
        predraft = self._by_seq.pop(seq_id, None)
        if predraft is None:
            return None
        same = len(committed) == len(predraft.base) and np.array_equal(np.asarray(committed), predraft.base)
        if same and k > 0:
            self.counts.used += 1
            self.counts.hidden_seconds += predraft.seconds
            return predraft.tokens[:k]
        self.counts.discarded += 1
        return None

    def forget(self, seq_id: Hashable) -> None:
        if self._by_seq.pop(seq_id, None) is not None:
            self.counts.discarded += 1

    def stopped(self) -> None:
        """A pre-draft stopped before it finished."""
        self.counts.discarded += 1


class PreDraftRunner:
    """Starts a proposer's pre-draft on its compute thread right after a call was answered (the thread is free
    until the next call), and tells a running one to stop as soon as the next call arrives."""

    def __init__(self) -> None:
        self._call_waiting = threading.Event()
        self.running: asyncio.Future | None = None  # the last pre-draft started (tests await it)

    def call_arrived(self) -> None:
        """A call is waiting for the compute thread: a running pre-draft stops after its current forward."""
        self._call_waiting.set()

    def start(self, compute: Executor, predraft: Callable[..., None], *args) -> None:
        """Run `predraft(*args, stop)` on `compute`; `stop()` says whether a call is waiting."""
        self._call_waiting.clear()
        self.running = asyncio.get_running_loop().run_in_executor(compute, predraft, *args,
                                                                  self._call_waiting.is_set)
        self.running.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future) -> None:
    """A pre-draft that failed only costs the next call a fresh draft (its sequences start afresh)."""
    if not future.cancelled() and future.exception() is not None:
        logger.error("a pre-draft failed: %r", future.exception())
