"""Asking the proposers for drafts, once per engine step, and keeping count of what they did.

Every proposer that running requests use is asked concurrently, each under its own deadline (draft_deadline.py:
it follows what the proposer's calls take), with all of its rows at once; a proposer that is late, fails or answers malformed costs its rows K = 0 for this step (counted as a
fallback, logged once per outage by proposer_outages.py), never the step. Nothing a proposer returns is trusted:
drafts are clipped to K and checked against the vocabulary before the engine verifies them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.common.proposer import Draft, DraftInput, Proposer
from services.verifier.draft_deadline import DraftDeadline
from services.verifier.proposer_outages import ProposerOutageLog
from services.verifier.request_state import RequestState
from services.verifier.spec_stats import SpecDecodeStats


@dataclass(frozen=True)
class ProposedDraft:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V]


NO_DRAFT = ProposedDraft([], None)


class DraftCollector:
    def __init__(
        self, proposers: Mapping[str, Proposer], vocab_size: int, draft_timeout_s: float,
        max_draft_timeout_s: float | None = None,
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

    async def collect(self, decode: Sequence[RequestState], lengths: Sequence[int]) -> list[ProposedDraft]:
        """One draft per decoding request (NO_DRAFT where its K, `lengths[i]`, is 0 or its proposer failed)."""
        drafts = [NO_DRAFT] * len(decode)
        groups: dict[str, list[tuple[int, int]]] = {}
        for index, (state, k) in enumerate(zip(decode, lengths, strict=True)):
            if k > 0:
                groups.setdefault(state.request.speculation.method, []).append((index, k))

        async def ask(method: str, members: list[tuple[int, int]]) -> None:
            inputs = [DraftInput(decode[i].request_id, decode[i].token_ids, k, decode[i].hidden_states())
                      for i, k in members]
            deadline = self.deadline(method)
            longest = max(k for _, k in members)
            timeout = deadline.for_call(longest)
            started = time.perf_counter()
            try:
                proposed = await asyncio.wait_for(self.proposers[method].propose(inputs), timeout=timeout)
            except TimeoutError as error:  # the engine's deadline, or a proposer's own just inside it
                self._fall_back(method, str(error) or f"missed the {timeout:.3f} s draft deadline", late=True)
                return
            except Exception as error:  # noqa: BLE001 - any proposer failure means K = 0, never a failed step
                self._fall_back(method, error)
                return
            if len(proposed) != len(inputs):
                self._fall_back(method, f"returned {len(proposed)} drafts for {len(inputs)} sequences")
                return
            deadline.answered(longest, time.perf_counter() - started)
            self._outages.succeeded(method)
            for (index, k), draft in zip(members, proposed, strict=True):
                drafts[index] = self._sanitize(draft, k)

        await asyncio.gather(*(ask(method, members) for method, members in groups.items()))
        return drafts

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
        self._outages.failed(method, error)

    def _sanitize(self, draft: Draft, k: int) -> ProposedDraft:
        """Trust nothing from a proposer: clip to K, drop out-of-vocabulary drafts and malformed q."""
        tokens = [int(t) for t in list(draft.token_ids)[:k]]
        vocab = self.vocab_size
        if not tokens or min(tokens) < 0 or max(tokens) >= vocab:
            return NO_DRAFT
        probs = draft.probs
        if probs is not None and (probs.dim() != 2 or probs.shape[0] < len(tokens) or probs.shape[1] != vocab):
            probs = None
        return ProposedDraft(tokens, None if probs is None else probs[: len(tokens)])
