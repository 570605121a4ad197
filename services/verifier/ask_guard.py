"""A check on adaptive speculation by what its steps realized: where the steps that asked for drafts have lately
committed fewer tokens for their time than the steps that did not, at the same load, the plan stops asking there
for a while, whatever its model predicts.

Why: the planner asks where its models (acceptance by row, step cost by shape, drafting and bookkeeping by rows)
predict that a wider step commits more tokens a second; where they are wrong, nothing in them says so. On an H200
at 64 chats (stop 74) ngram asked at 104 of 370 steps, and those steps took 62% longer than a plain step for 28%
more tokens: 0.91-0.94x no speculation, against the issue's 0.95x floor. The CPU's simulated device, with the
H200's verify premium, does not reproduce it (the planner there asks 25 times and reads 0.95-0.97x), so which
model errs is not known; this holds the floor wherever it is.

What is compared, per bucket of decoding rows (1, 2-3, 4-7, ...: powers of two, as cost_by_rows.py): the
decode-only steps' tokens a row against their time relative to the plain step the planner predicted for their rows
(so that a step of 40 rows and one of 60 in one bucket compare fairly, and a bias of the prediction cancels, as both
kinds are divided by it), summed over the last WINDOW steps of each kind: those that asked for drafts (a plan's)
and those that asked nothing. These are the steps plan_audit.py counts; the planner hands them on. Sums, not a
median: at one request most asking steps commit one token (no draft, or its first token rejected) and a few commit
several, and a median of such steps read a loss where asking ran 29% faster. A step's relative time counts at most
OUTLIER times (a pause is not the plan's).

Left out: steps that asked probes only (rationed apart, row_speculation.py), and steps whose drafter was late or
failed. Such a step's time includes a missed deadline, which the draft breaker acts on: counted here, a hung
drafter's late calls paused asking at 4 rows, and the breaker then never saw the second late call it needs to
open (tests/e2e's hung drafter).

Once both windows are full, asking loses where the asking steps' rate falls MARGIN below the plain steps'. Why so
wide a window and margin: at one request an asking step commits 1.4 tokens on average with a spread of about one
(ngram on the CPU bench's chat text), so by that spread 48 of them that pay 30% read below 0.9 of the plain rate
about once in a thousand windows, where 32 read below 0.95 about once in two hundred; a loss the guard is for is
larger (the H200's: 21%). The bucket then asks nothing for PAUSE_STEPS steps (probes go on: they keep measuring
acceptance, and keep calling the drafter, so its breaker still hears from it), after which its asking steps are
forgotten and the plan may ask again to be measured afresh (WINDOW losing steps each PAUSE_STEPS: about 2% of the
time at a 20% loss a step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 48  # the latest steps of each kind a bucket weighs; a verdict waits for both windows to be full
MARGIN = 0.10  # how far below the plain steps' rate the asking steps' must fall to stop asking
PAUSE_STEPS = 400  # steps a bucket asks nothing once asking lost, before it is measured again
OUTLIER = 4.0  # the most plain steps' time one step counts for


Step = tuple[float, float]  # (tokens a row, time relative to the predicted plain step)


def _rate(steps: deque[Step]) -> float:
    return sum(tokens for tokens, _ in steps) / sum(time for _, time in steps)


@dataclass
class _Bucket:
    asked: deque[Step] = field(default_factory=lambda: deque(maxlen=WINDOW))
    plain: deque[Step] = field(default_factory=lambda: deque(maxlen=WINDOW))
    paused_until: int = -1  # the step up to which it asks nothing


class AskGuard:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self.pauses = 0  # times a bucket stopped asking (for the metrics and the benches)

    def allows(self, rows: int, step: int) -> bool:
        """Whether a step of `rows` decoding rows at planner step `step` may ask for drafts."""
        bucket = self._buckets.get(max(1, rows).bit_length())
        if bucket is None or bucket.paused_until < 0:
            return True
        if step <= bucket.paused_until:
            return False
        bucket.paused_until = -1  # the pause is over: its asking is measured afresh
        bucket.asked.clear()
        return True

    def describe(self) -> str:
        """Per bucket of rows with steps of both kinds in its windows: the asking steps' rate against the plain
        steps' (above 1: asking paid there lately), and the pauses so far."""
        parts = [f"{1 << (b - 1)}-{(1 << b) - 1} rows {_rate(bucket.asked) / _rate(bucket.plain):.2f}x "
                 f"({len(bucket.asked)} asking, {len(bucket.plain)} plain)"
                 for b, bucket in sorted(self._buckets.items()) if bucket.asked and bucket.plain]
        return f"asking against plain by rows: {', '.join(parts) or 'none yet'}; pauses {self.pauses}"

    def observe(self, rows: int, asked: bool, tokens: int, seconds: float, plain_s: float, step: int) -> None:
        """A decode-only step of `rows` rows (a plan that asked for drafts, or none) committed `tokens` in `seconds`,
        where a plain step was predicted at `plain_s`."""
        if rows <= 0 or seconds <= 0 or plain_s <= 0:
            return
        bucket = self._buckets.setdefault(rows.bit_length(), _Bucket())
        (bucket.asked if asked else bucket.plain).append((tokens / rows, min(seconds / plain_s, OUTLIER)))
        if (asked and bucket.paused_until < 0 and len(bucket.asked) == WINDOW == len(bucket.plain)
                and _rate(bucket.asked) < (1 - MARGIN) * _rate(bucket.plain)):
            bucket.paused_until = step + PAUSE_STEPS
            self.pauses += 1
