"""Adaptive speculation: how many draft positions each row of a step verifies, chosen to maximise the expected
tokens committed per second of step time.

Every decoding row commits one token whatever happens; draft position j of row r adds a token with probability
P(r, j) (acceptance.py). The decode rows run as one padded forward, so a step's cost depends on its rows and its
*width* (1 + the longest draft verified), not on how many rows fill that width (step_cost.py). Ranking draft
positions across the batch therefore ranks columns: column j costs the same whether one row or all rows use it,
and is worth the sum over rows of P(r, j). The planner picks the width w that maximises

    (rows + sum over rows and positions j < w of P(r, j)) / predicted_seconds(rows, w, context)

and every row verifies up to w - 1 of its drafted tokens (a row's own bound, `num_speculative_tokens`, stays an
upper bound). w = 1, i.e. K = 0 for the whole batch, is a valid answer: a batch whose drafts are rarely accepted
runs as if speculation were off. Alone on a CPU, a step reads the weights once whatever its width, so one
request keeps long drafts; eight requests on the same CPU pay for each extra column.

Planning happens twice per step. Before drafting, with the estimates alone (weighted by how often each row's
proposer has a draft at all: an n-gram drafter on new text mostly has none), to bound what each proposer is asked
for; this plan also pays for the drafting itself (draft_cost.py: a draft model's K sequential forwards can cost
more than the verify step, and a step that asks for nothing does not call the drafter). After drafting, with the drafts in hand: only rows that got a draft
contribute gain, so the width is chosen again and drafts are cut to it.

Under load most plans choose width 1 and probe nothing; such a plan stands for the next few steps while nothing it
weighed changed (quiet_plan.py), so that those steps skip planning.

A step's draft tokens and its prompt chunks share max_num_batched_tokens: where prompts wait and that budget
binds, each draft token fed pushes a prompt token to a later step, and both plans price it (_displacement,
step_planning.PrefillBacklog); the engine plans the chunks once the drafts are in hand.

A token tree's positions are its nodes, best first (tree_budget.py): each widens the forward by one column and is
worth its depth's survival shared among the nodes at that depth, so a tree is cut to its best nodes as a chain is
cut to its first tokens, and under load the planner verifies a few of them, or none. Before drafting, a tree row is
planned as a chain whose j-th token is worth its survival there scaled by what its trees' j-th best nodes were worth
against it (_planned_gains), and asked for as many tokens as that plan affords: a tree of k tokens costs its
drafter at most k levels of k expansions (EAGLE; suffix trees are free), so a small ask is a cheap one, and which
of the tree's nodes are worth verifying is decided once it is in hand.

A request whose drafts are never verified teaches nothing, so it could stay at K = 0 after its estimate fell,
even when its text turns repetitive later. Such a row is re-probed: after `interval` steps without a verified
draft, it verifies one position; a rejected probe, or one the drafter had no draft for, doubles the interval, an
accepted one resets it. A probe that widens the step costs a column for the whole batch, and one that makes the
step call its drafter costs the call, so probes are rationed to 1% of step time, net of the tokens they win (one
request alone with a cheap drafter: a probe that lands pays for itself), and rows that are due probe together
(row_speculation.py).

Lossless for any schedule: which positions are verified depends on past outcomes and on the drafts, never on the
target's randomness for the positions being verified (see rejection.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.verifier.acceptance import AcceptanceEstimate, MethodAcceptance
from services.verifier.cost_by_rows import CostByRows
from services.verifier.draft_collection import ProposedDraft
from services.verifier.draft_cost import DraftCostModel
from services.verifier.plan_audit import PlanAudit
from services.verifier.plan_rows import PlanRows, column_gains
from services.verifier.quiet_plan import QuietPlan
from services.verifier.request_state import RequestState
from services.verifier.row_speculation import (
    PROBE_CHARGE_STEPS,
    ProbeBudget,
    ProbeSchedule,
    ProbeStep,
    RowSpeculation,
)
from services.verifier.step_cost import StepCostModel, StepShape
from services.verifier.step_planning import PrefillBacklog, prefill_room
from services.verifier.tree_budget import best_nodes, keep_nodes, node_gains

OVERHEAD_SMOOTHING = 0.05  # weight of the newest step in the moving average of step overhead
ASKING_SMOOTHING = 0.05  # weight of the newest step in the share of steps that asked (_openings_s)
TREE_YIELD_SMOOTHING = 0.5  # weight of a row's newest tree in its trees' yield (_observe_tree_yield)


def best_width(
    survivals: Sequence[Sequence[float]],
    span: int,
    cost: StepCostModel,
    overhead_s: float = 0.0,
    draft_s: Callable[[int], float] | None = None,
    speculative_overhead_s: float | None = None,
    displaced_s: Callable[[int], float] | None = None,
    weights: Sequence[float] | None = None,
) -> int:
    """The width maximising expected tokens per predicted second. `survivals[r][j - 1]` is P(row r's position j
    is accepted) for the positions row r can verify, counted `weights[r]` times (None: once each; before drafting,
    how often the row's proposer has a draft at all); `span` is the context the rows attend to; `overhead_s` is
    the step's time outside the verify forward and the drafting (bookkeeping) at width 1, `speculative_overhead_s`
    at any wider one (None: the same); `draft_s(k)` what drafting k tokens costs (None: already paid);
    `displaced_s(width)` what the prompt tokens that width's drafts push to a later step cost (None: nothing
    waits). With no cost observations yet (prediction 0) the widest is taken: the request's own K, as without
    adaptation."""
    columns = column_gains(survivals, weights)
    forward_s = forward_seconds(cost, len(survivals), span, 1 + len(columns))
    return best_width_of_columns(len(survivals), columns, forward_s, overhead_s, draft_s, speculative_overhead_s,
                                 displaced_s)


def forward_seconds(cost: StepCostModel, rows: int, span: int, widest: int) -> list[float]:
    """The predicted verify forward of `rows` rows attending to `span` tokens, at each width 1..`widest`."""
    return cost.predict_widths(rows, span, widest)


def best_width_of_columns(
    rows: int,
    columns: Sequence[float],
    forward_s: Sequence[float],
    overhead_s: float = 0.0,
    draft_s: Callable[[int], float] | None = None,
    speculative_overhead_s: float | None = None,
    displaced_s: Callable[[int], float] | None = None,
) -> int:
    """best_width from the column gains (column_gains) and the predicted forward at each width from 1 to at least
    1 + len(columns) (forward_seconds)."""
    widest = 1 + len(columns)
    best, best_rate = widest, -1.0
    expected_tokens = float(rows)
    wide_overhead_s = overhead_s if speculative_overhead_s is None else speculative_overhead_s
    for width in range(1, widest + 1):
        seconds = forward_s[width - 1]
        if width > 1:
            expected_tokens += columns[width - 2]
        if seconds <= 0:
            return widest
        seconds += (overhead_s if width == 1 else wide_overhead_s) + (draft_s(width - 1) if draft_s is not None
                                                                      else 0.0)
        if displaced_s is not None and width > 1:
            seconds += displaced_s(width)
        rate = expected_tokens / seconds
        if rate > best_rate:
            best, best_rate = width, rate
    return best


class SpeculationPlanner:
    """Draft lengths for each step's decoding rows; with `adaptive` off, every row drafts its full K."""

    def __init__(self, cost: StepCostModel, adaptive: bool) -> None:
        self.cost = cost
        self.adaptive = adaptive
        self.methods: dict[str, MethodAcceptance] = {}
        # a decode-only step's time outside its verify forward and drafting, and what a step that verified drafts
        # spends on top of that, both by the step's decoding rows
        self.overhead = CostByRows(OVERHEAD_SMOOTHING)
        self.speculative_extra = CostByRows(OVERHEAD_SMOOTHING)
        self.draft_cost = DraftCostModel()
        self.row_figures = PlanRows()  # what the first plan reads of its rows, kept while unchanged (plan_rows.py)
        self._quiet: QuietPlan | None = None  # the last plan, while it was plain and may stand (quiet_plan.py)
        self.audit = PlanAudit()  # what the first plans predicted against what their steps realized (plan_audit.py)
        self.probes = ProbeBudget()
        self._probe_column_s = 0.0  # this step's predicted cost of a probe column
        self._probe_step: ProbeStep | None = None  # this step's probes, until settle_probe
        self._opened = 0  # the rows this step asks for the first time (draft_cost.observe_opening)
        self.asking = 0.0  # the share of steps lately whose plan asked for drafts (ASKING_SMOOTHING: _openings_s)
        self._asked: list[int] = []  # the rows (indices) this step asked for drafts, until choose_drafts
        self._probing: list[RowSpeculation] = []  # ... of them the probes
        self.steps = 0  # steps planned so far: the clock of the rows' re-probes (row_speculation.ProbeSchedule)

    def start(self, method: str) -> RowSpeculation:
        """The speculation state of a newly admitted request using `method`."""
        prior = self.methods.get(method)
        if prior is None:
            prior = self.methods[method] = MethodAcceptance()
        return RowSpeculation(AcceptanceEstimate(prior), ProbeSchedule(since=self.steps))

    def draft_requests(self, decode: Sequence[RequestState], caps: Sequence[int],
                       backlog: PrefillBacklog | None = None) -> list[int]:
        """How many tokens to ask each row's proposer for: `caps[i]` is row i's bound (its K, the room left);
        `backlog`: the prompt tokens waiting to be prefilled (None: none)."""
        self.steps += 1
        self._probe_step = None
        for row in self._probing:  # a step that failed before settle_probe leaves its probes' flags set
            row.probing = False
        self._asked, self._probing = [], []
        if not self.adaptive or not decode or not any(caps):  # no row may draft: nothing to weigh
            return list(caps)
        figures = self.row_figures
        quiet = self._quiet
        if quiet is not None and quiet.stands(decode, caps, figures.version, figures.any_due(self.steps)
                                              and self.probes.would_afford(quiet.plain_s, quiet.probe_s)):
            self.probes.earn(quiet.plain_s, quiet.probe_s)
            self._observe_asking(False)
            self.audit.planned("plain", len(decode), len(decode), quiet.plain_s)
            return [0] * len(decode)
        self._quiet = None
        figures.read(decode, caps, self._planned_gains)
        rows, span = len(decode), _span(decode)
        overhead_s = self.overhead_s(rows)
        # at least to width 2, where a probe's column is priced
        forward_s = forward_seconds(self.cost, rows, span, max(2, 1 + len(figures.columns)))
        narrow = forward_s[0]
        askable = rows - caps.count(0)  # a step that asks asks every row that may draft
        draft_cost = self.draft_cost
        openings_s = self._openings_s(figures.unopened_remaining)

        def draft_s(k: int) -> float:
            return draft_cost.predict(k, askable) + openings_s if k > 0 else 0.0

        wide_overhead_s = self.speculative_overhead_s(rows)
        width = best_width_of_columns(rows, figures.columns, forward_s, overhead_s, draft_s, wide_overhead_s,
                                      self._displacement(caps, narrow + overhead_s, backlog))
        plain_s = narrow + overhead_s  # what a plain step is expected to take
        self._probe_column_s = max(0.0, forward_s[1] - narrow)
        token_s = plain_s / rows  # a token's share of a plain step: what a probe's win saves
        due: list[int] = []  # the rows a probe would ask
        if width == 1:
            due = self._probe_rows(decode, figures.due(self.steps), plain_s)
        # a step that asks no row for a draft makes no drafting call, unless a probe asks: then the probe pays for it
        # (priced for the rows it asks, one while none is due). Granted at no more than a plain step's time: a figure a
        # pause left high would otherwise keep away the very probes that measure it again (draft_cost.py);
        # settle_probe charges the probe what it really cost.
        probe_call_s = min(draft_cost.predict(1, max(1, len(due))), plain_s) if width == 1 else 0.0
        probe_s = self._probe_column_s + probe_call_s
        if due:  # granted at its cost less what its due rows are expected to win (settle_probe)
            probe_s -= token_s * sum(figures.first_wins[i] for i in due)
        can_probe = self.probes.earn(plain_s, max(0.0, probe_s))
        if width > 1:
            asks = [min(cap, width - 1) for cap in caps]
            self._asked = [i for i, ask in enumerate(asks) if ask > 0]
        else:  # a plain step (most under load) touches no row but the ones it probes
            asks = [0] * rows
            self._asked = due if can_probe else []
            for i in self._asked:
                asks[i] = 1
                self._probing.append(decode[i].speculation)
                decode[i].speculation.probing = True
        opened = 0
        for i in self._asked:
            row = decode[i].speculation
            if row is not None and not row.asked_before:
                row.asked_before = True
                opened += 1
        self._opened = opened
        if self._probing:
            self.probes.spend(probe_call_s)  # paid whatever comes back; the column only if a draft does
            self._probe_step = ProbeStep(plain_s, probe_call_s, token_s, opened=opened)
        self._observe_asking(width > 1)
        if width > 1:  # (a step whose prompts wait is not audited: its prefill is not in the plan)
            wide_s = forward_s[width - 1] + (overhead_s if wide_overhead_s is None else wide_overhead_s)
            self.audit.planned("asked", rows, rows + sum(figures.columns[: width - 1]), wide_s + draft_s(width - 1))
        elif self._probing:
            self.audit.planned("probed", rows, rows + sum(figures.first_wins[i] for i in self._asked),
                               plain_s + probe_call_s + self._probe_column_s)
        else:
            self.audit.planned("plain", rows, rows, plain_s)
            self._quiet = QuietPlan.of(decode, caps, figures.version, plain_s, max(0.0, probe_s))
        return asks

    def _observe_asking(self, asked: bool) -> None:
        """This step's plan asked for drafts or not: the share of steps that asked lately (_openings_s)."""
        self.asking += ASKING_SMOOTHING * (asked - self.asking)

    def _probe_rows(self, decode: Sequence[RequestState], due: list[int], plain_s: float) -> list[int]:
        """Of the rows `due` for a re-probe (longest due first), the most that one probe asks (in order): as many as
        a plain step's time pays the openings of (at least one). Due rows probe together, so that one call serves
        them all; but under a steady load most rows are new at a probe, and an EAGLE-like drafter probed 47-62 rows
        at once, opening each: 60-108 ms against a 5 ms step, charged four steps' time at most (PROBE_CHARGE_STEPS),
        so the probes took several times their share (engine_host_cost's chat text, eagle-sim with 1 ms openings,
        on a simulated H200 step at 64 rows). The call itself is not what bounds them: a figure a pause left high
        would then keep the probes from the very rows whose asks measure it again."""
        opening_s = self.draft_cost.opening_s
        count = len(due)
        while count > 1 and opening_s * sum(not decode[i].speculation.asked_before for i in due[:count]) > plain_s:
            count //= 2
        return sorted(due[:count])

    def _openings_s(self, remaining: Sequence[int]) -> float:
        """What an ask would add opening the rows never asked, `remaining[i]` the tokens the i-th may still write.
        An opening is paid once and serves the row's later asks too: each is shared among the asks its row can
        expect, 1 + its remaining tokens x the share of steps that asked lately. Alone with a drafter worth asking,
        that is most steps, and a 16 ms opening over gRPC is next to nothing an ask; at 64 chats where asks are
        rare, an opening is charged nearly in full (an H200's EAGLE-3 openings at 64 chats: 52.8 ms against a 7 ms
        step)."""
        if not remaining or not self.draft_cost.openings_known:
            return 0.0
        asking = self.asking
        return self.draft_cost.opening_s * sum(1.0 / (1.0 + asking * max(0, left)) for left in remaining)

    def choose_drafts(self, decode: Sequence[RequestState], drafts: Sequence[ProposedDraft],
                      backlog: PrefillBacklog | None = None) -> list[ProposedDraft]:
        """The drafts cut to the width chosen now that it is known which rows have one; `backlog` as for
        draft_requests."""
        if not self.adaptive or not decode:
            return list(drafts)
        asked, self._asked = self._asked, []
        for i in asked:
            row = decode[i].speculation
            if row is not None:
                row.drafts.observe(bool(drafts[i].tokens))
                self.row_figures.changed()
        if not any(d.tokens for d in drafts):
            return list(drafts)
        gains = [self._tree_gains(s, d) for s, d in zip(decode, drafts, strict=True)]
        for state, tree in zip(decode, gains, strict=True):
            if tree is not None and state.speculation is not None:
                self._observe_tree_yield(state, tree)
        survivals = [self._survival(s, len(d.tokens)) if g is None else sorted(g, reverse=True)
                     for s, d, g in zip(decode, drafts, gains, strict=True)]
        span, overhead_s = _span(decode), self.overhead_s(len(decode))
        waiting = backlog is not None and backlog.waiting > 0  # else nothing is displaced: no need to predict
        narrow_s = self.cost.predict(StepShape(len(decode), 1, span + 1)) + overhead_s if waiting else 0.0
        width = best_width(survivals, span, self.cost, overhead_s,
                           speculative_overhead_s=self.speculative_overhead_s(len(decode)),
                           displaced_s=self._displacement([len(d.tokens) for d in drafts], narrow_s, backlog))
        if width == 1 and self._probing and any(drafts[i].tokens for i in asked):  # a probing step asks probes only
            width = 2  # a probe pays for one column, which every drafted row then uses
            self.probes.spend(self._probe_column_s)
            if self._probe_step is not None:
                self._probe_step.charged_s += self._probe_column_s
        return [_cut(d, g, width - 1) for d, g in zip(drafts, gains, strict=True)]

    def settle_probe(self, step_s: float, measured: bool = True) -> None:
        """The step just taken lasted `step_s`. If it probed, its probes are charged what the step cost beyond the
        step predicted without them, in place of the call and column predicted when they were granted: a probe
        also pays a speculative step's bookkeeping, and its rows' first call opens them on the drafter. At 64 rows
        over gRPC a probe cost 4-7 ms where 2-2.5 was predicted, and probes took 1.0-2.1% of step time where 1% was
        allowed; settled at their cost, 0.6-1.4% (engine_host_cost's chat text on a simulated H200 step; above 1%
        where requests keep arriving: their steps prefill too, and are charged as predicted).
        `measured` False (a step that also prefilled, which the prediction leaves out): the predicted charge
        stands.

        What the probes won is given back: each accepted token is a token the batch did not need a step's share
        for (the predicted step's time over its rows). The ration bounds what probing *loses*. Alone with a cheap
        drafter, a probe's token is worth a whole step, and a probe that lands pays for itself and the next;
        counted as a cost only, a request whose first draft was rejected probed once in about 45 steps and often
        never asked again (eagle-sim at 1 request, 1 ms asks). At 64 rows a token is worth a 64th of a step, and
        the ration holds as before.

        A step is charged at most PROBE_CHARGE_STEPS plain steps' time, and one more for each row it opened: what a
        probe itself costs (a call, a column) is within that, and a step that took longer met something the probe did
        not cause and will not meet again (a graph captured inside the call, a pause). Charged in full, one such step
        silenced probing for good: on an H200 the EAGLE-3 trees were asked for nothing in 1,200 steps after a warm-up
        whose asks had graphs captured inside them (stop 65). But opening rows is no such accident: every new
        request needs it, and it grows with the rows (the whole history of each; an H200's EAGLE-3 opened 52 chats in
        14-29 ms, this machine's eagle-sim 64 rows in 117-139 ms against a 6 ms step). Capped at four steps, a probe
        that opened a batch's new rows was charged a fraction of its cost, and at 64 rows such probes took 4-8% of a
        short run where 1% is allowed (engine_host_cost's chat text, eagle-sim, simulated H200 step, 4 rounds: 4-6
        calls a run). Charged a step more a row opened: 1 call in three runs of four, 7 in the fourth (a probe
        whose step also prefilled is charged as predicted), and 7,900 -> 8,011 tok/s (means of four runs, one
        process alternating; ngram, whose openings cost little, the same)."""
        for row in self._probing:  # probes that came back without a draft (the others were observed)
            if row.probing:
                row.probe.unanswered(self.steps)
                row.probing = False
                self.row_figures.changed()  # its schedule moved
        self._probing = []
        self.audit.settled(step_s, measured)
        if self._probe_step is None:
            return
        probe, self._probe_step = self._probe_step, None
        if measured:  # what it really cost in place of what it was charged
            excess_s = min(max(0.0, step_s - probe.expected_s), (PROBE_CHARGE_STEPS + probe.opened) * probe.expected_s)
            self.probes.spend(excess_s - probe.charged_s)
        self.probes.spend(-probe.won_tokens * probe.token_s)

    def observe_row(self, state: RequestState, num_draft: int, num_accepted: int) -> None:
        """A row's verified draft updates its estimates and its re-probe schedule. A row that verified none need not
        be reported: its re-probe counts the planner's steps (row_speculation.ProbeSchedule), and a probe that came
        back without a draft is settled by settle_probe (reported here, it is settled here)."""
        row = state.speculation
        if row is None:
            return
        if num_draft:
            self.audit.accepted(num_accepted)
            row.acceptance.observe(num_draft, num_accepted)
            self.row_figures.changed()
            row.probe.verified(row.probing, num_accepted, self.steps)
            if row.probing and self._probe_step is not None:
                self._probe_step.won_tokens += num_accepted
        elif row.probing:
            row.probe.unanswered(self.steps)
            self.row_figures.changed()  # its schedule moved
        row.probing = False

    def observe_forward(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape, seconds)

    def observe_drafting(self, k: int, seconds: float, answered: bool = True) -> None:
        """Collecting the step's drafts, at most `k` tokens each (0: none asked), took `seconds`. A step that asked a
        row for the first time teaches the figure of an opening apart (draft_cost.observe_opening): a first call
        opens the sequence on the drafter (the whole prompt, for EAGLE its target states and the head's prefill; the
        link itself, for the first request), once per request, and measured as an ask's cost it made the planner
        stop asking (16 ms over gRPC against 0.5 ms a call after it).

        A step that asked only probes is averaged in without renewing its figure's age (draft_cost.py). Rationed net
        of what they win, probes come more often than a figure goes stale (100 steps): renewing it, they kept a
        figure that a pause left high from ever going stale, and averaged it down a fifth at a time. Not measured at
        all where a figure was current, instead, they no longer taught what they cost: ngram at 64 chats read 0.95x
        against 0.97x none with them measured (engine_host_cost's chat text on a simulated H200 step; within the
        noise of one batch, but low in each of three against the code before).

        `answered` False: some proposer was late or failed (its rows ran without drafts). Such a call is measured as
        before (a missed deadline at its deadline) where it opened no row; one that opened rows is not: taken for
        what openings cost, a hung drafter's 0.5 s deadlines priced every later opening at that, the asking stopped,
        and the breaker never saw the misses that open it (tests/e2e's hung drafter)."""
        if k > 0:  # _opened and _asked: set by draft_requests, which asked
            # _probe_step: set by draft_requests on a probing step, cleared by settle_probe
            renews, rows = self._probe_step is None, len(self._asked)
            if self._opened:  # (a call that was late or failed says nothing of what openings cost)
                if answered:
                    self.draft_cost.observe_opening(k, seconds, renews, rows, self._opened)
            else:
                self.draft_cost.observe(k, seconds, renews=renews, rows=rows)
        self.draft_cost.age()

    def observe_overhead(self, seconds: float, speculative: bool = False, rows: int = 1) -> None:
        """A decode-only step's wall time minus its verify forward and its drafting; `speculative`: the step
        verified drafts; `rows`: its decoding rows. Kept apart because a speculative step's bookkeeping costs more
        (the second plan, drafts cut and checked, several tokens a row committed): on an H100 at 64 chats the loop
        took 2.04 ms a step with ngram against 1.57 without, and a planner that counted only the average asked at
        a loss (0.79x none). Both grow with the rows, and are learned by rows (cost_by_rows.py)."""
        seconds = max(0.0, seconds)
        if not speculative:
            self.overhead.observe(rows, seconds)
            return
        self.speculative_extra.observe(rows, seconds - self.overhead_s(rows))

    def overhead_s(self, rows: int) -> float:
        """What a decode-only step of `rows` decoding rows is expected to spend outside its forward and its
        drafting (0 before any such step)."""
        return self.overhead.predict(rows) or 0.0

    def speculative_overhead_s(self, rows: int) -> float | None:
        """What a step of `rows` decoding rows that verifies drafts is expected to spend outside its forward and
        its drafting (None: no such step seen yet; the plain figure stands for it)."""
        extra = self.speculative_extra.predict(rows)
        return None if extra is None else self.overhead_s(rows) + max(0.0, extra)

    @staticmethod
    def _displacement(limits: Sequence[int], narrow_s: float, backlog: PrefillBacklog | None
                      ) -> Callable[[int], float] | None:
        """What a width's drafts cost in prompt tokens pushed to a later step, in seconds (None: no prompt waits).
        `limits[i]`: the most draft tokens row i feeds; `narrow_s`: the step's predicted time at width 1, its
        overhead included. A later step prefills the tokens pushed to it at no more compute than this one would
        have, but it is one more step: priced at the narrow step's predicted time (its fixed costs) for each
        budget's worth of prompt tokens pushed. Without it, a batch whose prompts were
        still being prefilled spent half the budget on drafts of which a quarter were accepted, and the prefill of
        64 chats took 19 steps instead of 14 (engine_host_cost --text chat, simulated H200 step)."""
        if backlog is None or not backlog.waiting:
            return None
        narrow = len(limits)
        per_token_s = narrow_s / prefill_room(backlog.max_num_batched_tokens, narrow)

        def displaced_s(width: int) -> float:
            return per_token_s * backlog.displaced(narrow, sum(1 + min(limit, width - 1) for limit in limits))

        return displaced_s

    @staticmethod
    def _survival(state: RequestState, cap: int) -> Sequence[float]:
        """P(each position is accepted) for up to `cap` positions (for a tree: each depth)."""
        row = state.speculation
        if row is None or cap <= 0:
            return ()
        return row.acceptance.survival(cap)

    @classmethod
    def _planned_gains(cls, state: RequestState, cap: int) -> Sequence[float]:
        """What each of a row's first `cap` draft tokens is expected to add, as the first plan (before drafting)
        values them: a chain's survival by position; a tree row's j-th token scaled by its trees' yield at j (the
        last yield known for positions past its trees'). A tree of k tokens spends some of them on siblings, which
        add less than k chain positions would (tree_budget.py): valued as a chain, tree rows were asked for nodes
        the plan after drafting then cut (on an H200 at 8 chats, 841 rows asked for EAGLE-3 trees, 144 verified,
        each ask 4.9 ms). One yield for the whole tree instead kept swinging: a 1-token tree yields what a chain
        does, so the next ask was large again, and its siblings were cut again."""
        survival = cls._survival(state, cap)
        row = state.speculation
        if row is None or not row.tree_yield:
            return survival
        last = len(row.tree_yield) - 1
        return [p * row.tree_yield[min(j, last)] for j, p in enumerate(survival)]

    def _observe_tree_yield(self, state: RequestState, gains: Sequence[float]) -> None:
        """A tree came for this row, its nodes worth `gains`: its j-th best node's gain over the chain's j-th
        survival is averaged into the row's yield at j (TREE_YIELD_SMOOTHING), which the first plan reads next."""
        survival = self._survival(state, len(gains))
        yields = state.speculation.tree_yield
        for j, (gain, chain) in enumerate(zip(sorted(gains, reverse=True), survival)):
            observed = min(1.0, gain / chain) if chain > 0 else 1.0
            if j == len(yields):
                yields.append(observed)
            else:
                yields[j] += TREE_YIELD_SMOOTHING * (observed - yields[j])
        self.row_figures.changed()

    @classmethod
    def _tree_gains(cls, state: RequestState, draft: ProposedDraft) -> list[float] | None:
        """A tree draft's node gains (tree_budget.py); None for a chain. The survival read is as long as the tree has
        nodes, not just as deep as it is (the positions past its depth are read by no node): the same read that
        _observe_tree_yield then makes, which the row's estimate then serves from its cache."""
        if draft.parents is None:
            return None
        return node_gains(draft, cls._survival(state, len(draft.tokens)))


def _span(decode: Sequence[RequestState]) -> int:
    return max(len(s.token_ids) for s in decode)


def _cut(draft: ProposedDraft, gains: list[float] | None, k: int) -> ProposedDraft:
    """At most k draft tokens: a chain's first k, a tree's k best nodes."""
    if len(draft.tokens) <= k:
        return draft
    return draft.cut(k) if gains is None else keep_nodes(draft, best_nodes(gains, k))
