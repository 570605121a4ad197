"""A step-cost model with SmolLM2-135M's cost shape on 2 CPU cores, fixed, for tests of the adaptive planner: a
tiny model's real step costs are nearly flat in the width and vary with the machine, so decisions would too."""

from __future__ import annotations

from services.verifier.step_cost import StepCostModel, StepShape


class FixedCost(StepCostModel):
    """SmolLM2-135M's cost shape on 2 CPU cores, not refined by the tiny model's timings (so tests do not
    depend on this machine's speed)."""

    def __init__(self, base=0.016, per_row=0.001, per_token=0.0009) -> None:
        super().__init__()
        for rows in (1, 4, 8, 16):
            for width in (1, 2, 5, 9):
                super().observe(StepShape(rows, width, 256), base + per_row * rows + per_token * rows * width)
        self.fit()

    def observe(self, shape, seconds) -> None:
        pass
