"""What the first plan of each step predicted against what the step realized, by kind of step: where the planner's
figures are wrong in the way that decides whether asking for drafts pays.

The first plan (speculation_planner.draft_requests) prices every width before drafting: tokens (each row's one,
plus the columns' expected gains) against seconds (the forward, the bookkeeping, the drafting). It asks where
that rate beats a plain step's. On an H200 at 64 chats (stop 74) ngram asked at 104 of 370 steps, and those steps
cost 62% more than a plain step for 28% more tokens: the plan expected more of them, but whether it expected too
many tokens or too few seconds, no figure said. Each part is learned on its own (step_cost.py, cost_by_rows.py,
draft_cost.py, acceptance.py), and each leaves something out by design (a drafter's openings, the shapes the fit
weighs little), so what counts is the sum, on the steps the plan chose: those it chose to ask are the ones whose
estimates were high.

Kinds: "asked" (the plan chose a width above 1), "probed" (a plain width with probes asked), "plain" (neither).
Only decode-only steps count (a step that also prefilled takes longer than any plan of its decode rows says).
A diagnostic: the bench prints it (accelerator_step, engine_host_cost); nothing acts on it."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("asked", "probed", "plain")


@dataclass
class KindTotals:
    """Sums over the steps of one kind: predicted and realized tokens committed and seconds."""

    steps: int = 0
    predicted_tokens: float = 0.0
    realized_tokens: float = 0.0
    predicted_s: float = 0.0
    realized_s: float = 0.0

    def describe(self) -> str:
        predicted = self.predicted_tokens / max(self.predicted_s, 1e-12) / 1000
        realized = self.realized_tokens / max(self.realized_s, 1e-12) / 1000
        return (f"{self.steps} steps, tokens {self.realized_tokens / self.steps:.1f} "
                f"({self.realized_tokens / max(self.predicted_tokens, 1e-12):.2f}x predicted), ms "
                f"{1000 * self.realized_s / self.steps:.2f} ({self.realized_s / max(self.predicted_s, 1e-12):.2f}x), "
                f"tokens a ms {realized:.3g} (predicted {predicted:.3g})")


@dataclass
class PendingStep:
    kind: str
    rows: int
    predicted_tokens: float
    predicted_s: float
    accepted: int = 0  # draft tokens the step's rows had accepted (each row commits one more)


class PlanAudit:
    def __init__(self) -> None:
        self.kinds: dict[str, KindTotals] = {}
        self._pending: PendingStep | None = None

    def planned(self, kind: str, rows: int, predicted_tokens: float, predicted_s: float) -> None:
        """The first plan of the step under way: of `kind`, for `rows` decoding rows."""
        self._pending = PendingStep(kind, rows, predicted_tokens, predicted_s)

    def accepted(self, tokens: int) -> None:
        """A row of the step under way had `tokens` draft tokens accepted."""
        if self._pending is not None:
            self._pending.accepted += tokens

    def settled(self, step_s: float, measured: bool) -> None:
        """The step under way took `step_s`; `measured` False: it also prefilled, and is not counted."""
        step, self._pending = self._pending, None
        if step is None or not measured or step.predicted_s <= 0:  # (no prediction before the cost model's fit)
            return
        totals = self.kinds.setdefault(step.kind, KindTotals())
        totals.steps += 1
        totals.predicted_tokens += step.predicted_tokens
        totals.realized_tokens += step.rows + step.accepted
        totals.predicted_s += step.predicted_s
        totals.realized_s += step_s

    def reset(self) -> None:
        self.kinds.clear()
        self._pending = None

    def describe(self) -> str:
        """One line: each kind's steps, tokens and ms a step as realized and against the plan's prediction."""
        parts = [f"{kind} {self.kinds[kind].describe()}" for kind in KINDS if kind in self.kinds]
        return "; ".join(parts) if parts else "no decode-only step planned"
