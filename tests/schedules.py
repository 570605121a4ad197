"""A speculation schedule that changes at random every step, to check that output never depends on how many
draft positions the engine verifies (the adaptive planner's choices are one such schedule among many)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.verifier.draft_collection import ProposedDraft
from services.verifier.request_state import RequestState
from services.verifier.speculation_planner import SpeculationPlanner
from services.verifier.step_cost import StepCostModel
from services.verifier.step_planning import PrefillBacklog


class RandomSchedulePlanner(SpeculationPlanner):
    """Asks every row for its full K, then cuts each row's draft to a random length (0 included)."""

    def __init__(self, seed: int) -> None:
        super().__init__(StepCostModel(), adaptive=False)
        self.rng = random.Random(seed)
        self.lengths_used: set[int] = set()

    def choose_drafts(self, decode: Sequence[RequestState], drafts: Sequence[ProposedDraft],
                      backlog: PrefillBacklog | None = None) -> list[ProposedDraft]:
        out = []
        for draft in drafts:
            k = self.rng.randint(0, len(draft.tokens))
            self.lengths_used.add(k)
            out.append(ProposedDraft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k]))
        return out
