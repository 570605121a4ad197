"""The start-up step-cost profile (step_cost.py), kept in the measurement store (measurement_store.py) and reused by
the next start with the same setup, thread placement and profile shapes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.verifier.measurement_store import MeasurementStore
from services.verifier.step_cost import PROFILE_CONTEXT, PROFILE_REPEATS, StepCostModel

logger = logging.getLogger(__name__)

KIND = "step-cost"


@dataclass(frozen=True)
class StepCostCache:
    """Where profiles are kept, and what the engine cannot see for itself: the setup (measurement_store.
    setup_identity: the machine, the model and its dtype) and the thread the forwards were placed on."""

    store: MeasurementStore
    setup: dict[str, Any]
    compute_thread: str

    def identity(self, max_rows: int, max_width: int) -> dict[str, Any]:
        """Everything a profile's timings depend on. Two starts with equal identities reuse one profile."""
        return {**self.setup, "compute_thread": self.compute_thread, "max_rows": max_rows, "max_width": max_width,
                "profile": [PROFILE_CONTEXT, PROFILE_REPEATS]}

    def load(self, identity: dict[str, Any], model: StepCostModel) -> bool:
        """Load a stored profile for `identity` into `model` (and fit it); False (model untouched) if there is
        none, or it is old or unusable."""
        found = self.store.load(KIND, identity)
        if found is None:
            return False
        result, age = found
        try:
            samples = [(int(s["rows"]), int(s["width"]), int(s["span"]), [float(x) for x in s["seconds"]])
                       for s in result]
        except (KeyError, TypeError, ValueError) as error:
            logger.warning("ignoring the stored step-cost profile (%s); measuring", error)
            return False
        model.restore(samples)
        if not model.fitted:
            return False
        logger.info("step-cost profile reused from %s (measured %.1f h ago): %s",
                    self.store.path(KIND, identity), age / 3600, model.describe())
        return True

    def save(self, identity: dict[str, Any], model: StepCostModel) -> None:
        samples = [{"rows": r, "width": w, "span": s, "seconds": seconds} for r, w, s, seconds in model.samples()]
        self.store.save(KIND, identity, samples)
