"""The soak's report and its pass/fail targets, kept apart from the traffic and the processes so the target
logic is tested on its own."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from services.soak.traffic import Outcome, TrafficResult


@dataclass(frozen=True)
class Targets:
    """What a soak must show: nothing but clean 503s went wrong, the verifier is idle again afterwards, and no
    service's resident memory grew by more than `max_memory_growth` after the warm-up."""

    max_failures: int = 0
    max_memory_growth: float = 0.05


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(len(values), *(percentile(values, q) for q in (50, 90, 99)))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no values): an observed value, never an interpolation."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Memory:
    """One service's resident memory after the warm-up and at the end; pids tell a restart apart."""

    service: str
    start_pid: int | None
    start_bytes: int | None
    end_pid: int | None
    end_bytes: int | None

    @property
    def restarted(self) -> bool:
        return self.start_pid != self.end_pid

    @property
    def growth(self) -> float | None:
        if self.restarted or not self.start_bytes or self.end_bytes is None:
            return None
        return self.end_bytes / self.start_bytes - 1


@dataclass(frozen=True)
class SoakReport:
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    ttft_s: Percentiles
    itl_s: Percentiles
    memory: list[Memory]
    running_at_end: int | None
    waiting_at_end: int | None
    failure_examples: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, traffic: TrafficResult, memory: list[Memory], running: int | None,
              waiting: int | None) -> SoakReport:
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, outcome), count in sorted(traffic.by_kind.items()):
            by_kind.setdefault(kind, {})[str(outcome)] = count
        return cls(
            duration_s=traffic.elapsed_s, requests=sum(traffic.outcomes.values()),
            outcomes={str(o): traffic.outcomes.get(o, 0) for o in Outcome}, by_kind=by_kind,
            ttft_s=Percentiles.of(traffic.timings.ttft_s), itl_s=Percentiles.of(traffic.timings.itl_s),
            memory=memory, running_at_end=running, waiting_at_end=waiting,
            failure_examples=list(traffic.failure_examples),
        )

    @property
    def failures(self) -> int:
        return sum(count for name, count in self.outcomes.items() if Outcome(name).is_failure)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["failures"] = self.failures
        data["memory"] = [{**asdict(m), "growth": m.growth, "restarted": m.restarted} for m in self.memory]
        return data


def missed_targets(report: SoakReport, targets: Targets) -> list[str]:
    """Every target the run missed, as a sentence; empty when it passed."""
    missed = []
    if report.failures > targets.max_failures:
        missed.append(f"{report.failures} failed requests (allowed {targets.max_failures}; clean 503s excepted)")
    if report.requests == 0 or report.outcomes.get(str(Outcome.OK), 0) == 0:
        missed.append("no request succeeded")
    if report.running_at_end != 0 or report.waiting_at_end != 0:
        missed.append(f"the verifier still has {report.running_at_end} running and {report.waiting_at_end} "
                      "waiting requests after the traffic stopped")
    for memory in report.memory:
        if memory.restarted:
            missed.append(f"{memory.service} was restarted during the soak (pid {memory.start_pid} -> "
                          f"{memory.end_pid})")
        elif memory.growth is None:
            missed.append(f"{memory.service}: no memory reading")
        elif memory.growth > targets.max_memory_growth:
            missed.append(f"{memory.service} resident memory grew {memory.growth:.1%} after the warm-up "
                          f"(allowed {targets.max_memory_growth:.0%})")
    return missed


def _ms(p: Percentiles) -> str:
    return f"p50 {p.p50 * 1e3:.0f} ms, p90 {p.p90 * 1e3:.0f} ms, p99 {p.p99 * 1e3:.0f} ms (n={p.count})"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def format_report(report: SoakReport, missed: list[str]) -> str:
    rate = report.requests / max(report.duration_s, 1e-9)
    lines = [f"soak: {report.requests} requests in {report.duration_s:.0f} s ({rate:.1f}/s)", "outcomes:"]
    lines += [f"  {name:<16} {count}" for name, count in report.outcomes.items() if count]
    lines.append(f"  {'failures':<16} {report.failures}")
    lines.append("by kind:")
    lines += [f"  {kind:<18} " + ", ".join(f"{o} {c}" for o, c in outcomes.items())
              for kind, outcomes in report.by_kind.items()]
    lines.append(f"TTFT (streaming): {_ms(report.ttft_s)}")
    lines.append(f"ITL (between content chunks): {_ms(report.itl_s)}")
    lines.append("resident memory (after warm-up -> end):")
    for m in report.memory:
        growth = "restarted" if m.restarted else ("-" if m.growth is None else f"{m.growth:+.1%}")
        lines.append(f"  {m.service:<9} {_mib(m.start_bytes)} -> {_mib(m.end_bytes)} ({growth})")
    lines.append(f"verifier at the end: {report.running_at_end} running, {report.waiting_at_end} waiting")
    if report.failure_examples:
        lines.append("first failures:")
        lines += [f"  {example}" for example in report.failure_examples]
    lines.append("targets: " + ("all met" if not missed else "MISSED"))
    lines += [f"  - {sentence}" for sentence in missed]
    return "\n".join(lines)
