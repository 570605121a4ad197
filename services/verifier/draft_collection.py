"""Asking the proposers for drafts, once per engine step, and keeping count of what they did.

Every proposer that running requests use is asked concurrently, each under its own deadline (draft_deadline.py:
it follows what the proposer's calls take), with all of its rows at once; a proposer that is late, fails or answers malformed costs its rows K = 0 for this step (counted as a
fallback, logged once per outage by proposer_outages.py), never the step. A proposer late or failing several
calls in a row is not asked at all until a background probe answers in time (draft_breaker.py), so a hung drafter
stops costing each step its deadline. Nothing a proposer returns is trusted: drafts are clipped to K and checked
against the vocabulary before the engine verifies them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from services.common.proposer import Draft, DraftInput, Proposer, capabilities_of
from services.common.token_trees import leaf_paths
from services.verifier.draft_breaker import DraftBreaker
from services.verifier.draft_deadline import DraftDeadline
from services.verifier.proposer_outages import ProposerOutageLog
from services.verifier.request_state import RequestState
from services.verifier.runner_kept_states import catch_up
from services.verifier.spec_stats import SpecDecodeStats


@dataclass(frozen=True)
class ProposedDraft:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V]
    parents: list[int] | None = None  # a token tree (Draft.parents; with probs, a q-tree); None: a chain
    path_probs: list[float] | None = None  # with a tree, optional: each node's (Draft.path_probs), in [0, 1]

    def cut(self, k: int) -> ProposedDraft:
        """The first k tokens (a tree's first k nodes are a tree: parents come first)."""
        if k <= 0:
            return NO_DRAFT
        return ProposedDraft(self.tokens[:k], None if self.probs is None else self.probs[:k],
                             None if self.parents is None else self.parents[:k],
                             None if self.path_probs is None else self.path_probs[:k])

    def first_path(self) -> ProposedDraft:
        """A tree cut to its first root-to-leaf path (a chain): for a runner without `supports_trees`, a request
        one grammar matcher follows, or a proposer that does not declare `sends_trees`."""
        if self.parents is None:
            return self
        path = leaf_paths(self.parents)[0]  # each node its parent's first draw: a chain drawn from the same q
        return ProposedDraft([self.tokens[i] for i in path], None if self.probs is None else self.probs[path])


NO_DRAFT = ProposedDraft([], None)


class DraftCollector:
    def __init__(
        self, proposers: Mapping[str, Proposer], vocab_size: int, draft_timeout_s: float,
        max_draft_timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`draft_timeout_s`: the shortest deadline; `max_draft_timeout_s` the longest (default: the shortest,
        i.e. a fixed deadline)."""
        self.proposers = dict(proposers)  # by method name; requests select one by name
        self.vocab_size = vocab_size
        self.draft_timeout_s = draft_timeout_s
        self.max_draft_timeout_s = max(draft_timeout_s, max_draft_timeout_s or draft_timeout_s)
        self.deadlines: dict[str, DraftDeadline] = {}
        self.stats_by_method: dict[str, SpecDecodeStats] = {}  # speculation counts per proposer
        self._outages = ProposerOutageLog()
        self.breakers: dict[str, DraftBreaker] = {}
        self._probes: set[asyncio.Task] = set()
        self._clock = clock
        self.fallback_calls = 0  # calls (or skipped asks) whose rows ran without drafts, over every method

    async def collect(self, decode: Sequence[RequestState], lengths: Sequence[int]) -> list[ProposedDraft]:
        """One draft per decoding request (NO_DRAFT where its K, `lengths[i]`, is 0 or its proposer failed)."""
        drafts = [NO_DRAFT] * len(decode)
        if not any(lengths):  # most steps under load ask nothing: one pass in C, not a loop over the rows
            return drafts
        groups: dict[str, list[tuple[int, int]]] = {}
        for index, (state, k) in enumerate(zip(decode, lengths, strict=True)):
            if k > 0:
                groups.setdefault(state.request.speculation.method, []).append((index, k))
        if not groups:
            return drafts

        async def ask(method: str, members: list[tuple[int, int]]) -> None:
            breaker = self.breaker(method)
            if breaker.is_open:
                breaker.skip()
                self._fall_back(method, "not asked while its circuit breaker is open")
                if breaker.probe_due(self._clock()):
                    catch_up(decode[i].hidden for i, _ in members)
                    self._start_probe(method, [self._input(decode[i], k) for i, k in members])
                return
            catch_up(decode[i].hidden for i, _ in members)  # states the runner kept: one read for all the rows
            inputs = [self._input(decode[i], k) for i, k in members]
            proposed = await self._call(method, inputs)
            if proposed is not None:
                trees = capabilities_of(self.proposers[method]).sends_trees
                for (index, k), draft in zip(members, proposed, strict=True):
                    drafts[index] = self._sanitize(draft, k, trees)

        if len(groups) == 1:  # the usual step: one method, asked without a task around it
            await ask(*next(iter(groups.items())))
        else:
            await asyncio.gather(*(ask(method, members) for method, members in groups.items()))
        return drafts

    async def _call(self, method: str, inputs: list[DraftInput], probe: bool = False) -> Sequence[Draft] | None:
        """One call under the proposer's deadline; None (counted as a fallback unless `probe`) if it was late,
        failed or malformed. Feeds the deadline's cost model and the breaker either way."""
        deadline = self.deadline(method)
        breaker = self.breaker(method)
        longest = max(d.num_speculative_tokens for d in inputs)
        timeout = deadline.for_call(longest, len(inputs))
        started = time.perf_counter()
        problem: BaseException | str | None = None
        late = False
        try:
            # a timeout scope rather than wait_for, which wraps the call in a task of its own: one more turn of the
            # loop for every call, about 17 us against an in-process lookup of about 10 us a row
            async with asyncio.timeout(timeout):
                proposed = await self.proposers[method].propose(inputs)
        except TimeoutError as error:  # the engine's deadline, or a proposer's own just inside it
            problem, late = str(error) or f"missed the {timeout:.3f} s draft deadline", True
        except Exception as error:  # noqa: BLE001 - any proposer failure means K = 0, never a failed step
            problem = error
        else:
            if len(proposed) != len(inputs):
                problem = f"returned {len(proposed)} drafts for {len(inputs)} sequences"
        if problem is not None:
            if probe:
                breaker.probe_failed(self._clock())
            else:
                self._fall_back(method, problem, late)
                breaker.missed(self._clock(), str(problem) or type(problem).__name__)
            return None
        deadline.answered(longest, time.perf_counter() - started, len(inputs))
        breaker.answered(self._clock())
        self._outages.succeeded(method)
        return proposed

    def _start_probe(self, method: str, inputs: list[DraftInput]) -> None:
        """Ask an open breaker's proposer in the background; its drafts are thrown away, its timing counts."""
        task = asyncio.get_running_loop().create_task(self._call(method, inputs, probe=True),
                                                      name=f"specserve-probe-{method}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def cancel_probes(self) -> None:
        """Stop the probes in flight (at shutdown: nothing of the engine may outlive it)."""
        probes = list(self._probes)
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)

    @staticmethod
    def _input(state: RequestState, k: int) -> DraftInput:
        """The proposer's view of a row: its tokens as a snapshot, so a call that outlives the step (a probe of an
        open breaker) reads the tokens of its own step while the engine appends more."""
        sampling = state.request.sampling
        spec = state.request.speculation
        return DraftInput(state.request_id, state.committed_view(), k, state.hidden_states(), spec.draft_pipelining,
                          0.0 if sampling.greedy else sampling.temperature, spec.prediction,
                          state.num_prompt_tokens if spec.prediction else 0)

    def readmit(self, method: str) -> None:
        """Close `method`'s breaker on outside evidence that it answers in time (a health probe)."""
        breaker = self.breakers.get(method)
        if breaker is not None and breaker.is_open:
            breaker.answered(self._clock())
            self._outages.succeeded(method)

    def breaker(self, method: str) -> DraftBreaker:
        found = self.breakers.get(method)
        if found is None:
            found = self.breakers[method] = DraftBreaker(method)
        return found

    def deadline(self, method: str) -> DraftDeadline:
        found = self.deadlines.get(method)
        if found is None:
            found = self.deadlines[method] = DraftDeadline(self.draft_timeout_s, self.max_draft_timeout_s)
        return found

    @property
    def stats(self) -> SpecDecodeStats:
        """Counts over every proposer, assembled when asked (steps record per proposer only)."""
        return SpecDecodeStats.merged(list(self.stats_by_method.values()))

    def num_fallbacks(self, method: str) -> int:
        """Steps in which `method`'s proposal was late, failed or malformed (its rows ran with K = 0)."""
        stats = self.stats_by_method.get(method)
        return stats.num_fallbacks if stats is not None else 0

    def method_stats(self, method: str) -> SpecDecodeStats:
        stats = self.stats_by_method.get(method)
        if stats is None:
            stats = self.stats_by_method[method] = SpecDecodeStats()
        return stats

    def _fall_back(self, method: str, error: BaseException | str, late: bool = False) -> None:
        """`method`'s rows run with K = 0 this step: counted (`late`: also as a late proposal, the sign of a
        drafter too slow for the target's step rather than a broken one), and logged once per outage."""
        stats = self.method_stats(method)
        stats.num_fallbacks += 1
        stats.num_late_proposals += int(late)
        self.fallback_calls += 1
        self._outages.failed(method, error)

    def _sanitize(self, draft: Draft, k: int, trees: bool) -> ProposedDraft:
        """Trust nothing from a proposer: clip to K, drop out-of-vocabulary drafts, malformed trees and malformed
        q; a tree from a proposer that does not declare `sends_trees` is cut to its first path."""
        tokens = [int(t) for t in list(draft.token_ids)[:k]]
        vocab = self.vocab_size
        if not tokens or min(tokens) < 0 or max(tokens) >= vocab:
            return NO_DRAFT
        parents = None if draft.parents is None else [int(p) for p in list(draft.parents)[: len(tokens)]]
        if parents is not None:
            if len(parents) < len(tokens) or any(not -1 <= p < i for i, p in enumerate(parents)):
                return NO_DRAFT
        probs = _valid_probs(draft.probs, len(tokens), vocab)
        if parents is not None:
            if not trees:
                return ProposedDraft(tokens, probs, parents).first_path()
            if parents == list(range(-1, len(tokens) - 1)):
                parents = None  # a chain after all
        # A q-tree's nodes are cut by depth and order only (tree_budget.py), never by their own likelihood, which
        # would bias which draws its multi-draft acceptance sees (tree_rejection.py): its path probabilities go.
        path_probs = _path_probs(draft.path_probs, len(tokens)) if parents is not None and probs is None else None
        return ProposedDraft(tokens, probs, parents, path_probs)


def _valid_probs(probs: torch.Tensor | None, num_tokens: int, vocab: int) -> torch.Tensor | None:
    """q for the first num_tokens drafts if it has a row of probabilities (each in [0, 1]) over the target's vocabulary
    for each, else None (the drafts are then verified as deterministic ones, lossless whatever q was)."""
    if probs is None or probs.dim() != 2 or probs.shape[0] < num_tokens or probs.shape[1] != vocab:
        return None
    probs = probs[:num_tokens]
    low, high = torch.aminmax(probs)  # one pass; NaN fails both comparisons, as does infinity the second
    return probs if bool(low >= 0) and bool(high <= 1) else None


def _path_probs(values: Sequence[float] | None, num_tokens: int) -> list[float] | None:
    """A tree's path probabilities if there is one for each node and each is a probability, else None (the
    planner then counts a depth's nodes alike)."""
    if values is None or len(values) < num_tokens:
        return None
    kept = [float(v) for v in list(values)[:num_tokens]]
    return kept if all(0.0 <= v <= 1.0 for v in kept) else None  # NaN fails both comparisons
