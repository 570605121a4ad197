"""Benchmark results: per-generation records, table rows, the target ratios, text and markdown rendering.

Kept free of torch and of the engine so the numbers can be recomputed from a --json file and so the smoke test
can check the report's shape without a real model.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Generation:
    """One request's result. `num_steps`: target forwards (transformers) or engine steps that emitted tokens
    for it, so tokens/step is comparable across systems; drafts/accepted only where speculation ran.

    Through the HTTP API there are no token ids, only the response's `text` and `usage.completion_tokens`
    (`reported_tokens`); `tokens` is then empty. In-process generations get `text` too (decoded the way the
    gateway decodes) when they are compared with HTTP ones."""

    tokens: tuple[int, ...]
    seconds: float
    num_steps: int
    num_drafts: int = 0
    num_accepted: int = 0
    text: str | None = None
    reported_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.reported_tokens if self.reported_tokens is not None else len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def same_output(x: Generation, y: Generation) -> bool:
    """Token ids where both sides have them; otherwise (an HTTP response) the text and the token count."""
    if x.reported_tokens is None and y.reported_tokens is None:
        return x.tokens == y.tokens
    if x.text is None or y.text is None:
        raise ValueError("comparing with an HTTP generation needs the text of both outputs")
    return x.text == y.text and x.num_tokens == y.num_tokens


@dataclass(frozen=True)
class Measurement:
    """All generations of one system on one workload. Single-request: one entry per prompt and repeat, timed
    each on its own. Concurrent: `batch_seconds[r]` is the wall time of repeat r's whole batch."""

    key: str  # hf-plain | hf-pld | off-1 | ngram-1 | suffix-1 | off-N | ngram-N | suffix-N | http-off-1 | http-ngram-1
    workload: str
    system: str
    concurrency: int
    generations: tuple[tuple[Generation, ...], ...]  # [repeat][prompt or batch member]
    batch_seconds: tuple[float, ...] = ()
    speculative: bool = False


@dataclass(frozen=True)
class Row:
    key: str
    workload: str
    system: str
    concurrency: int
    tokens_per_s: float  # single: median over prompts of per-prompt tok/s; concurrent: aggregate
    output_tokens: int  # per repeat
    seconds: float  # per repeat: sum of per-prompt times (single) or batch wall time (concurrent)
    tokens_per_step: float
    mean_acceptance_length: float | None  # 1 + accepted/drafts, vLLM's definition; None without speculation


@dataclass(frozen=True)
class Check:
    """Token-identity comparison of two rows' outputs, prompt by prompt. `required` ones fail the run."""

    name: str
    workload: str
    mismatches: int
    total: int
    required: bool


@dataclass(frozen=True)
class Ratio:
    name: str
    workload: str
    value: float
    target: float

    @property
    def met(self) -> bool:
        return self.value >= self.target


@dataclass(frozen=True)
class RatioSpec:
    name: str
    numerator: str  # row key
    denominator: str
    workloads: tuple[str, ...]
    target: float


_EDIT = ("code-edit",)
_BOTH = ("humaneval", "code-edit")
_SEQUENCE = ("edit-sequence",)
RATIO_SPECS = (
    RatioSpec("specserve off (1 req) / transformers plain", "off-1", "hf-plain", _BOTH, 1.0),
    RatioSpec("specserve ngram / specserve off (1 req)", "ngram-1", "off-1", _EDIT, 1.5),
    RatioSpec("specserve ngram / transformers prompt lookup (1 req)", "ngram-1", "hf-pld", _EDIT, 1.0),
    RatioSpec("specserve suffix / specserve off (1 req)", "suffix-1", "off-1", _SEQUENCE, 2.0),
    RatioSpec("specserve suffix / specserve ngram (1 req)", "suffix-1", "ngram-1", _SEQUENCE, 1.0),
    RatioSpec("concurrent aggregate / 1 request (spec off)", "off-N", "off-1", _BOTH, 3.0),
    # End to end: the gateway (HTTP, JSON, detokenization) and the gRPC links must cost under 10% at 1 request.
    RatioSpec("HTTP API ngram / in-process ngram (1 req)", "http-ngram-1", "ngram-1", _BOTH, 0.9),
    RatioSpec("HTTP API off / in-process off (1 req)", "http-off-1", "off-1", _BOTH, 0.9),
)


@dataclass
class BenchResult:
    header: dict[str, str]
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def ratios(self) -> list[Ratio]:
        return compute_ratios(self.rows)

    @property
    def failed_checks(self) -> int:
        return sum(c.mismatches for c in self.checks if c.required)

    def to_json(self) -> dict:
        return {
            "header": self.header,
            "rows": [asdict(r) for r in self.rows],
            "ratios": [asdict(r) | {"met": r.met} for r in self.ratios],
            "checks": [asdict(c) for c in self.checks],
        }


def merge_rounds(rounds: Sequence[Sequence[Measurement]]) -> list[Measurement]:
    """Join the same (workload, system) measurement of several rounds into one with a repeat per round."""
    merged: dict[tuple[str, str], Measurement] = {}
    for measurements in rounds:
        for m in measurements:
            key = (m.workload, m.key)
            if key not in merged:
                merged[key] = m
                continue
            first = merged[key]
            merged[key] = Measurement(
                first.key,
                first.workload,
                first.system,
                first.concurrency,
                first.generations + m.generations,
                first.batch_seconds + m.batch_seconds,
                first.speculative,
            )
    return list(merged.values())


def summarize(m: Measurement) -> Row:
    """Median over repeats (per prompt, or per batch) first, so one noisy repeat does not move the row."""
    flat = [g for repeat in m.generations for g in repeat]
    num_repeats = len(m.generations)
    if m.concurrency > 1:
        per_repeat = [
            sum(g.num_tokens for g in rep) / s for rep, s in zip(m.generations, m.batch_seconds, strict=True)
        ]
        tokens_per_s = statistics.median(per_repeat)
        seconds = statistics.median(m.batch_seconds)
    else:
        per_prompt = [statistics.median(g.tokens_per_s for g in column) for column in zip(*m.generations)]
        tokens_per_s = statistics.median(per_prompt)
        seconds = sum(g.seconds for g in flat) / num_repeats
    drafts = sum(g.num_drafts for g in flat)
    acceptance = 1 + sum(g.num_accepted for g in flat) / drafts if m.speculative and drafts else None
    return Row(
        key=m.key,
        workload=m.workload,
        system=m.system,
        concurrency=m.concurrency,
        tokens_per_s=tokens_per_s,
        output_tokens=sum(g.num_tokens for g in flat) // num_repeats,
        seconds=seconds,
        tokens_per_step=sum(g.num_tokens for g in flat) / max(1, sum(g.num_steps for g in flat)),
        mean_acceptance_length=acceptance,
    )


def compare(name: str, workload: str, a: Measurement, b: Measurement, required: bool) -> Check:
    """Compare the first repeat's outputs request by request (both measurements ran the same prompts)."""
    pairs = list(zip(a.generations[0], b.generations[0], strict=True))
    return Check(name, workload, sum(not same_output(x, y) for x, y in pairs), len(pairs), required)


def compute_ratios(rows: Sequence[Row]) -> list[Ratio]:
    by_key = {(r.workload, r.key): r for r in rows}
    ratios = []
    for spec in RATIO_SPECS:
        for workload in spec.workloads:
            top, bottom = by_key.get((workload, spec.numerator)), by_key.get((workload, spec.denominator))
            if top is None or bottom is None:
                continue
            value = top.tokens_per_s / bottom.tokens_per_s if bottom.tokens_per_s > 0 else math.nan
            ratios.append(Ratio(spec.name, workload, value, spec.target))
    return ratios


_COLUMNS = ("workload", "system", "req", "tok/s", "out tok", "wall s", "tok/step", "mean acc len")


def _cells(row: Row) -> tuple[str, ...]:
    acceptance = "-" if row.mean_acceptance_length is None else f"{row.mean_acceptance_length:.2f}"
    return (
        row.workload,
        row.system,
        str(row.concurrency),
        f"{row.tokens_per_s:.1f}",
        str(row.output_tokens),
        f"{row.seconds:.1f}",
        f"{row.tokens_per_step:.2f}",
        acceptance,
    )


def format_table(rows: Sequence[Row]) -> str:
    cells = [_COLUMNS, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    def justify(i: int, text: str) -> str:  # text columns left, numbers right
        return text.ljust(widths[i]) if i < 2 else text.rjust(widths[i])

    lines = ["  ".join(justify(i, c) for i, c in enumerate(line)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: Sequence[Row]) -> str:
    align = ["---"] * 2 + ["---:"] * (len(_COLUMNS) - 2)  # text left, numbers right
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def format_ratios(ratios: Sequence[Ratio]) -> str:
    width = max((len(f"{r.name} [{r.workload}]") for r in ratios), default=0)
    return "\n".join(
        f"{f'{r.name} [{r.workload}]'.ljust(width)}  {r.value:6.3f}x  (target >= {r.target:.2f})  "
        f"{'MET' if r.met else 'NOT MET'}"
        for r in ratios
    )


def format_checks(checks: Sequence[Check]) -> str:
    lines = []
    for c in checks:
        verdict = "identical" if c.mismatches == 0 else f"{c.mismatches}/{c.total} DIFFER"
        kind = "required" if c.required else "informational"
        lines.append(f"{c.name} [{c.workload}]: {verdict} ({c.total} outputs, {kind})")
    return "\n".join(lines)


def format_report(result: BenchResult) -> str:
    header = "\n".join(f"{k}: {v}" for k, v in result.header.items())
    parts = [
        "== specserve benchmark ==",
        header,
        "",
        format_table(result.rows),
        "",
        "== ratios ==",
        format_ratios(result.ratios),
        "",
        "== greedy equality ==",
        format_checks(result.checks),
    ]
    if result.failed_checks:
        parts.append(f"WARNING: {result.failed_checks} output(s) differ where they must be identical")
    parts += ["", "== markdown ==", format_markdown(result.rows)]
    return "\n".join(parts)
