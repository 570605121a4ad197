"""`python -m services.bench.sweep`: speculation off, each fixed K and adaptive K across a concurrency sweep.

Why a sweep and not the bench's two points: speculation pays at one request (a step is bound by reading the
weights, so verifying K+1 positions costs little more than one) and can lose as the batch grows (the verify forward
turns compute-bound, and every row's rejected drafts are paid for by the whole batch). Adaptive speculation is meant
to keep the first gain without the second loss. This sweep checks that at 1, 4, 8 and 16 concurrent requests, on
HumanEval (little to copy from the prompt) and on the code edit (the answer is mostly the prompt), against the
best fixed K chosen after the fact at each point, which no fixed setting could know in advance.

Targets (the issue): adaptive >= 0.98x no speculation at every point, and >= 0.9x the best fixed K at 1 request.
Every speculative output must equal the output without speculation for the same prompt (exit code 1 otherwise).

Throughput is total output tokens / the batch's wall time (prefill included). Inter-token latency is per token:
each output chunk's gap since the request's previous chunk, divided over the chunk's tokens (a speculative step
emits several at once); the first chunk's wait is time to first token and is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field

import torch

from services.bench import available_cores, stderr_progress
from services.bench.hardware import describe_hardware
from services.bench.prompts import Workload
from services.bench.specserve_runs import RequestIds, fresh_proposer, speculation
from services.common.drafter_methods import method_names, why_not_runnable
from services.common.main_thread_compute import run_with_compute, worker_thread
from services.common.speculative_config import SpeculativeConfig
from services.modeling.compute_placement import choose_compute_thread
from services.modeling.registry import DEFAULT_MODEL
from services.modeling.runner import ModelRunner
from services.modeling.runner_factory import create_runner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.request_stream import RequestStream
from services.verifier.sampling_params import GenerationRequest, SamplingParams

Progress = Callable[[str], None]
WARMUP_TOKENS = 8
NONE, ADAPTIVE = "none", "adaptive"
TARGET_VS_NONE = 0.98  # adaptive / none, at every point
TARGET_VS_BEST_FIXED = 0.9  # adaptive / the best fixed K, at 1 request


@dataclass(frozen=True)
class SweepSettings:
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    fixed_k: tuple[int, ...] = (2, 4, 8)  # adaptive gets the largest as its upper bound
    method: str = "ngram"
    prompt_lookup_min: int = 2  # the bench's n-gram sizes
    prompt_lookup_max: int = 4
    repeats: int = 1
    compute_thread: str = "auto"


@dataclass(frozen=True)
class SweepMode:
    """One column of the sweep: speculation off (k = 0), a fixed K, or adaptive with `k` as its upper bound."""

    name: str  # "none", "K=4", "adaptive"
    k: int = 0
    adaptive: bool = False


def sweep_modes(fixed_k: Sequence[int]) -> list[SweepMode]:
    return [SweepMode(NONE), *(SweepMode(f"K={k}", k) for k in fixed_k), SweepMode(ADAPTIVE, max(fixed_k), True)]


# -- raw results -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestTrace:
    """One request of a batch: its tokens, and when each output chunk that carried tokens arrived."""

    tokens: tuple[int, ...]
    chunk_times: tuple[float, ...]  # seconds after the batch was submitted
    chunk_sizes: tuple[int, ...]  # tokens per chunk
    num_drafts: int = 0  # engine steps that verified drafts for this request
    num_accepted: int = 0  # draft tokens accepted over those steps


@dataclass(frozen=True)
class BatchRun:
    """One mode at one (workload, concurrency) in one round: `concurrency` requests submitted at once."""

    workload: str
    concurrency: int
    mode: str
    round: int
    wall_s: float
    requests: tuple[RequestTrace, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


# -- pure computations: latency, per-point medians, best fixed K, targets, equality ---------------------------


def token_gaps(chunk_times: Sequence[float], chunk_sizes: Sequence[int]) -> list[float]:
    """Per-token inter-token latency of one request: a chunk of n tokens that arrived g seconds after the
    previous chunk counts as n tokens of g/n each, which is what a streaming client sees. The first chunk is
    skipped: its wait is time to first token (queueing and prefill), not an inter-token gap."""
    gaps = []
    for previous, now, size in zip(chunk_times, chunk_times[1:], chunk_sizes[1:]):
        gaps += [(now - previous) / size] * size
    return gaps


def median_itl_s(requests: Sequence[RequestTrace]) -> float | None:
    """Median over every token of every request; None when no request got a second chunk."""
    gaps = [g for r in requests for g in token_gaps(r.chunk_times, r.chunk_sizes)]
    return statistics.median(gaps) if gaps else None


@dataclass(frozen=True)
class PointStats:
    """One mode at one (workload, concurrency), as medians across rounds (one noisy round does not move it)."""

    workload: str
    concurrency: int
    mode: str
    tokens_per_s: float
    median_itl_ms: float | None
    accepted_per_draft: float | None  # accepted draft tokens per step that verified drafts; None: none drafted
    output_tokens: int  # per round (the first; greedy output is the same every round)


def point_stats(runs: Sequence[BatchRun]) -> PointStats:
    """`runs`: the rounds of one mode at one point."""
    first = runs[0]
    itls = [itl for itl in (median_itl_s(r.requests) for r in runs) if itl is not None]
    drafts = sum(q.num_drafts for r in runs for q in r.requests)
    accepted = sum(q.num_accepted for r in runs for q in r.requests)
    return PointStats(
        workload=first.workload,
        concurrency=first.concurrency,
        mode=first.mode,
        tokens_per_s=statistics.median(r.tokens_per_s for r in runs),
        median_itl_ms=statistics.median(itls) * 1000 if itls else None,
        accepted_per_draft=accepted / drafts if drafts else None,
        output_tokens=first.num_tokens,
    )


def summarize_points(runs: Sequence[BatchRun]) -> list[PointStats]:
    """One PointStats per (workload, concurrency, mode), in the order the runs first appear."""
    groups: dict[tuple[str, int, str], list[BatchRun]] = {}
    for run in runs:
        groups.setdefault((run.workload, run.concurrency, run.mode), []).append(run)
    return [point_stats(group) for group in groups.values()]


def best_fixed(fixed: Sequence[PointStats]) -> PointStats:
    """The fixed K with the highest throughput at this point (the smaller K on a tie: listed first)."""
    return max(fixed, key=lambda p: p.tokens_per_s)


def _ratio(top: float, bottom: float) -> float:
    return top / bottom if bottom > 0 else float("nan")


@dataclass(frozen=True)
class SweepRow:
    """Every mode at one (workload, concurrency): one row of a workload's table."""

    workload: str
    concurrency: int
    none: PointStats
    fixed: tuple[PointStats, ...]  # in --fixed-k order
    adaptive: PointStats

    @property
    def best_fixed(self) -> PointStats:
        return best_fixed(self.fixed)

    @property
    def adaptive_vs_none(self) -> float:
        return _ratio(self.adaptive.tokens_per_s, self.none.tokens_per_s)

    @property
    def adaptive_vs_best_fixed(self) -> float:
        return _ratio(self.adaptive.tokens_per_s, self.best_fixed.tokens_per_s)


def sweep_rows(points: Sequence[PointStats], fixed_modes: Sequence[str]) -> list[SweepRow]:
    """Points grouped into rows, in workload order of first appearance, then by concurrency."""
    by_point: dict[tuple[str, int], dict[str, PointStats]] = {}
    for p in points:
        by_point.setdefault((p.workload, p.concurrency), {})[p.mode] = p
    order = {name: i for i, name in enumerate(dict.fromkeys(p.workload for p in points))}
    rows = [
        SweepRow(workload, c, modes[NONE], tuple(modes[m] for m in fixed_modes), modes[ADAPTIVE])
        for (workload, c), modes in by_point.items()
    ]
    return sorted(rows, key=lambda r: (order[r.workload], r.concurrency))


def _where(row: SweepRow) -> str:
    return f"{row.workload}, {row.concurrency} request{'s' if row.concurrency != 1 else ''}"


@dataclass(frozen=True)
class Target:
    description: str
    met: bool | None  # None: the sweep had no point to judge it on
    detail: str

    def line(self) -> str:
        verdict = {True: "met", False: "not met", None: "not measured"}[self.met]
        return f"{self.description}: {verdict} ({self.detail})"


def sweep_targets(rows: Sequence[SweepRow]) -> list[Target]:
    """The issue's two targets, judged on the per-point medians."""
    vs_none = f"adaptive >= {TARGET_VS_NONE:g}x none at every point"
    if rows:
        worst = min(rows, key=lambda r: r.adaptive_vs_none)
        first = Target(vs_none, worst.adaptive_vs_none >= TARGET_VS_NONE,
                       f"min {worst.adaptive_vs_none:.3f}x at {_where(worst)}")
    else:
        first = Target(vs_none, None, "no points")
    vs_best = f"adaptive >= {TARGET_VS_BEST_FIXED:g}x best fixed K at 1 request"
    single = [r for r in rows if r.concurrency == 1]
    if single:
        detail = ", ".join(f"{r.workload} {r.adaptive_vs_best_fixed:.3f}x of {r.best_fixed.mode}" for r in single)
        second = Target(vs_best, all(r.adaptive_vs_best_fixed >= TARGET_VS_BEST_FIXED for r in single), detail)
    else:
        second = Target(vs_best, None, "concurrency 1 was not in the sweep")
    return [first, second]


@dataclass(frozen=True)
class EqualityCheck:
    """A speculative mode's outputs against speculation off's at the same point, request by request."""

    workload: str
    concurrency: int
    mode: str
    mismatches: int
    total: int

    def line(self) -> str:
        verdict = "identical" if not self.mismatches else f"{self.mismatches}/{self.total} DIFFER"
        return f"greedy {self.mode} vs none [{self.workload}, {self.concurrency} concurrent]: {verdict} " \
               f"({self.total} outputs)"


def equality_checks(runs: Sequence[BatchRun]) -> list[EqualityCheck]:
    """Every round of every speculative mode against the first round of "none" at the same point: a batch's
    i-th request has the same prompt in every mode, so greedy decoding must give the same tokens."""
    reference = {}
    for run in runs:
        if run.mode == NONE:
            reference.setdefault((run.workload, run.concurrency), run)
    counts: dict[tuple[str, int, str], list[int]] = {}
    for run in runs:
        if run.mode == NONE:
            continue
        expected = reference[run.workload, run.concurrency]
        pairs = list(zip(run.requests, expected.requests, strict=True))
        count = counts.setdefault((run.workload, run.concurrency, run.mode), [0, 0])
        count[0] += sum(a.tokens != b.tokens for a, b in pairs)
        count[1] += len(pairs)
    return [EqualityCheck(w, c, m, bad, total) for (w, c, m), (bad, total) in counts.items()]


# -- the report ------------------------------------------------------------------------------------------------


@dataclass
class SweepResult:
    header: dict[str, str]
    fixed_modes: tuple[str, ...]
    runs: list[BatchRun] = field(default_factory=list)

    @property
    def points(self) -> list[PointStats]:
        return summarize_points(self.runs)

    @property
    def rows(self) -> list[SweepRow]:
        return sweep_rows(self.points, self.fixed_modes)

    @property
    def targets(self) -> list[Target]:
        return sweep_targets(self.rows)

    @property
    def checks(self) -> list[EqualityCheck]:
        return equality_checks(self.runs)

    @property
    def failed_checks(self) -> int:
        return sum(c.mismatches for c in self.checks)

    def to_json(self) -> dict:
        return {
            "header": self.header,
            "fixed_modes": list(self.fixed_modes),
            "points": [asdict(p) for p in self.points],
            "targets": [asdict(t) for t in self.targets],
            "checks": [asdict(c) for c in self.checks],
            "runs": [asdict(r) for r in self.runs],
        }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """First column left-aligned text, the rest right-aligned numbers."""
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def format_throughput_table(rows: Sequence[SweepRow]) -> str:
    """One workload: tok/s of every mode, the best fixed K, the two ratios and the median inter-token latency."""
    fixed = [p.mode for p in rows[0].fixed] if rows else []
    columns = ["req", "none tok/s", *(f"{m} tok/s" for m in fixed), "adaptive tok/s", "best fixed",
               "adaptive/none", "adaptive/best fixed", "ITL none ms", "ITL best fixed ms", "ITL adaptive ms"]
    cells = [
        [str(r.concurrency), f"{r.none.tokens_per_s:.1f}", *(f"{p.tokens_per_s:.1f}" for p in r.fixed),
         f"{r.adaptive.tokens_per_s:.1f}", r.best_fixed.mode, f"{r.adaptive_vs_none:.2f}x",
         f"{r.adaptive_vs_best_fixed:.2f}x", _ms(r.none.median_itl_ms), _ms(r.best_fixed.median_itl_ms),
         _ms(r.adaptive.median_itl_ms)]
        for r in rows
    ]
    return _markdown(columns, cells)


def format_acceptance_table(rows: Sequence[SweepRow]) -> str:
    """One workload: accepted draft tokens per step that verified drafts, per speculative mode."""
    modes = [*(p.mode for p in rows[0].fixed), ADAPTIVE] if rows else []
    cells = [
        [str(r.concurrency), *("-" if p.accepted_per_draft is None else f"{p.accepted_per_draft:.2f}"
                               for p in (*r.fixed, r.adaptive))]
        for r in rows
    ]
    return _markdown(["req", *modes], cells)


def format_report(result: SweepResult) -> str:
    rows = result.rows
    parts = ["## Concurrency sweep", "", *(f"- {k}: {v}" for k, v in result.header.items())]
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        parts += ["", f"### {workload}", "", format_throughput_table(mine), "",
                  "Accepted draft tokens per drafted step:", "", format_acceptance_table(mine)]
    parts += ["", "### Targets", "", *(f"- {t.line()}" for t in result.targets)]
    parts += ["", "### Greedy equality", "", *(f"- {c.line()}" for c in result.checks)]
    if result.failed_checks:
        parts.append(f"\nFAILED: {result.failed_checks} speculative output(s) differ from speculation off")
    return "\n".join(parts)


# -- driving the engine ----------------------------------------------------------------------------------------


def batch_prompts(prompts: Sequence[Sequence[int]], concurrency: int) -> list[tuple[int, ...]]:
    """The first `concurrency` prompts, cycled when the workload has fewer."""
    return [tuple(p) for p in itertools.islice(itertools.cycle(prompts), concurrency)]


def max_model_len(workloads: Sequence[Workload], max_k: int) -> int:
    """Positions per KV slot: the longest prompt plus the largest budget, and room for one step's drafts."""
    return max(len(p) for w in workloads for p in w.prompts) + max(w.max_tokens for w in workloads) + max_k + 2


def engine_config(mode: SweepMode) -> EngineConfig:
    """The bench's engine settings; only adaptive_speculation differs between modes."""
    return EngineConfig(max_num_batched_tokens=512, log_stats_interval_s=0, adaptive_speculation=mode.adaptive)


def proposer_config(settings: SweepSettings, mode: SweepMode) -> SpeculativeConfig | None:
    if mode.k == 0:
        return None
    return SpeculativeConfig(method=settings.method, num_speculative_tokens=mode.k,
                             prompt_lookup_min=settings.prompt_lookup_min, prompt_lookup_max=settings.prompt_lookup_max)


async def trace(stream: RequestStream, started: float) -> RequestTrace:
    """Consume one request's stream, stamping every chunk that carries tokens as it arrives."""
    tokens: list[int] = []
    times: list[float] = []
    sizes: list[int] = []
    last = None
    async for output in stream:
        now = time.perf_counter()
        if output.token_ids:
            tokens += output.token_ids
            times.append(now - started)
            sizes.append(len(output.token_ids))
        last = output
    spec = last.spec if last is not None else None
    return RequestTrace(tuple(tokens), tuple(times), tuple(sizes),
                        spec.num_drafts if spec else 0, spec.num_accepted_tokens if spec else 0)


async def run_batch(
    engine: Engine, ids: RequestIds, prompts: Sequence[Sequence[int]], max_tokens: int, settings: SweepSettings,
    mode: SweepMode,
) -> tuple[float, tuple[RequestTrace, ...]]:
    """Every request added before the engine's next step (so they start together), then all awaited; returns
    the wall time from submission to the last token and each request's trace."""
    spec = speculation(settings.method, mode.k)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requests = [GenerationRequest(ids.next(mode.name), tuple(p), sampling, spec) for p in prompts]
    started = time.perf_counter()
    streams = [engine.add_request(r) for r in requests]
    try:
        traces = await asyncio.gather(*(trace(s, started) for s in streams))
    finally:
        for stream in streams:
            stream.abort()
    return time.perf_counter() - started, tuple(traces)


async def until_idle(engine: Engine) -> None:
    """The engines share one runner's slots: wait until this one has freed every slot it used."""
    while engine.num_running or engine.num_waiting:
        await asyncio.sleep(0.001)


async def measure_point(
    engine: Engine, ids: RequestIds, workload: Workload, concurrency: int, settings: SweepSettings,
    mode: SweepMode, round_number: int, progress: Progress,
) -> BatchRun:
    config = proposer_config(settings, mode)
    if config is not None:
        fresh_proposer(engine, config)  # no history carried over from another point (suffix remembers answers)
    prompts = batch_prompts(workload.prompts, concurrency)
    wall, traces = await run_batch(engine, ids, prompts, workload.max_tokens, settings, mode)
    await until_idle(engine)
    run = BatchRun(workload.name, concurrency, mode.name, round_number, wall, traces)
    progress(f"  {mode.name}: {run.num_tokens} tokens in {wall:.2f} s ({run.tokens_per_s:.1f} tok/s)")
    return run


async def warm_up(engine: Engine, ids: RequestIds, settings: SweepSettings, mode: SweepMode,
                  prompt: Sequence[int]) -> None:
    config = proposer_config(settings, mode)
    if config is not None:
        fresh_proposer(engine, config)
    await run_batch(engine, ids, [prompt], WARMUP_TOKENS, settings, mode)
    await until_idle(engine)


async def measure_sweep(
    runner: ModelRunner, compute: Executor, workloads: Sequence[Workload], settings: SweepSettings,
    eos_token_ids: Sequence[int], progress: Progress,
) -> list[BatchRun]:
    """Every mode at every (workload, concurrency), `repeats` rounds. One engine per mode (their configs
    differ), all on the one runner and compute thread and alive together, so that each point runs its modes
    one right after the other: a noisy spell on a shared machine then hits a point's modes alike rather than
    one mode's every point. Only one engine has requests at a time, and it has freed its slots before the next
    one starts."""
    modes = sweep_modes(settings.fixed_k)
    ids = RequestIds()
    runs = []
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for mode in modes:
            progress(f"engine start and warm-up: {mode.name}")
            engine = await stack.enter_async_context(Engine(runner, engine_config(mode), {}, eos_token_ids, compute))
            await warm_up(engine, ids, settings, mode, workloads[0].prompts[0])
            engines[mode.name] = engine
        for round_number in range(settings.repeats):
            for workload in workloads:
                for concurrency in settings.concurrency:
                    progress(f"round {round_number + 1}/{settings.repeats}, {workload.name}, "
                             f"{concurrency} concurrent")
                    for mode in modes:
                        runs.append(await measure_point(engines[mode.name], ids, workload, concurrency, settings,
                                                        mode, round_number, progress))
    return runs


def run_sweep(
    model: torch.nn.Module, workloads: Sequence[Workload], settings: SweepSettings, eos_token_ids: Sequence[int],
    header: dict[str, str], progress: Progress,
) -> SweepResult:
    """The whole sweep on already-tokenized workloads (the smoke test calls this with a tiny model): one runner
    with a slot per request of the largest batch, its forwards on the thread the start-up measurement picks."""
    runner = create_runner(model, max_num_seqs=max(settings.concurrency),
                           max_model_len=max_model_len(workloads, max(settings.fixed_k)))
    with worker_thread() as worker:
        placement, timing = choose_compute_thread(settings.compute_thread, runner, worker)
        runs = run_with_compute(placement, worker, lambda compute: measure_sweep(
            runner, compute, workloads, settings, eos_token_ids, progress
        ))
    header = {
        **header,
        "specserve kernels": getattr(runner, "kernels", type(runner).__name__),
        "specserve compute thread": placement + (f" ({timing.describe()})" if timing else " (forced)"),
    }
    fixed_modes = tuple(m.name for m in sweep_modes(settings.fixed_k) if m.k and not m.adaptive)
    return SweepResult(header, fixed_modes, runs)


# -- command line ----------------------------------------------------------------------------------------------


def build_workloads(tokenizer, num_prompts: int, humaneval_max_tokens: int, edit_max_tokens: int) -> list[Workload]:
    """HumanEval with `num_prompts` distinct problems (16 concurrent requests are 16 different problems), and the
    code edit as the four renames of the edit-sequence file (cycled in larger batches)."""
    from services.bench.prompts import (
        CODE_EDIT_RENAME,
        EDIT_SEQUENCE_RENAMES,
        chat_token_ids,
        code_edit_message,
        humaneval_messages,
    )

    humaneval = tuple(chat_token_ids(tokenizer, m) for m in humaneval_messages(num_prompts))
    renames = (CODE_EDIT_RENAME, *EDIT_SEQUENCE_RENAMES)
    edits = tuple(chat_token_ids(tokenizer, code_edit_message(r)) for r in renames)
    return [Workload("humaneval", humaneval, humaneval_max_tokens), Workload("code-edit", edits, edit_max_tokens)]


def int_list(text: str) -> tuple[int, ...]:
    """"1,4,8" -> (1, 4, 8); every value >= 1."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.bench.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--method", default=SweepSettings.method, choices=method_names(), help="drafter method")
    parser.add_argument("--concurrency", type=int_list, default=None, help="concurrent requests (1,4,8,16)")
    parser.add_argument("--fixed-k", type=int_list, default=None,
                        help="fixed K values (2,4,8); adaptive gets the largest as its upper bound")
    parser.add_argument("--num-prompts", type=int, default=None, help="distinct HumanEval problems (16)")
    parser.add_argument("--max-tokens", type=int, default=None, help="HumanEval max new tokens (128)")
    parser.add_argument("--edit-max-tokens", type=int, default=None, help="code-edit max new tokens (256)")
    parser.add_argument("--prompt-lookup-min", type=int, default=SweepSettings.prompt_lookup_min)
    parser.add_argument("--prompt-lookup-max", type=int, default=SweepSettings.prompt_lookup_max)
    parser.add_argument("--repeats", type=int, default=1, help="rounds; points report medians across rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: available cores)")
    parser.add_argument("--compute-thread", choices=["auto", "main", "worker"], default="auto",
                        help="thread for the engine's forwards; auto measures both, as the verifier does")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run that checks the setup (2 prompts, concurrency 1,2, K 2,4, 16/32 tokens)")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    parser.add_argument("--png", default=None,
                        help="figure path (default docs/concurrency_sweep.png; --quick writes none unless given); "
                             "'' for none")
    args = parser.parse_args(argv)
    defaults = {  # (--quick, full run)
        "concurrency": ((1, 2), SweepSettings.concurrency),
        "fixed_k": ((2, 4), SweepSettings.fixed_k),
        "num_prompts": (2, 16),
        "max_tokens": (16, 128),
        "edit_max_tokens": (32, 256),
        "png": ("", "docs/concurrency_sweep.png"),
    }
    for name, (quick_value, full_value) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick_value if args.quick else full_value)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def describe_workloads(workloads: Sequence[Workload]) -> str:
    return "; ".join(
        f"{w.name}: {len(w.prompts)} distinct prompt(s) of {min(map(len, w.prompts))}-{max(map(len, w.prompts))} "
        f"tokens (cycled to fill a batch), max {w.max_tokens} new"
        for w in workloads
    )


def describe_modes(settings: SweepSettings) -> str:
    ngram = (f", prompt_lookup_min {settings.prompt_lookup_min}, max {settings.prompt_lookup_max}"
             if settings.method == "ngram" else "")
    return (f"none; {settings.method} with fixed K in {', '.join(map(str, settings.fixed_k))} (adaptive_speculation "
            f"off); {settings.method} adaptive with K <= {max(settings.fixed_k)} (adaptive_speculation on){ngram}")


def main(argv: Sequence[str] | None = None) -> int:
    from services.modeling.loading import load_model

    args = parse_args(sys.argv[1:] if argv is None else argv)
    settings = SweepSettings(args.concurrency, args.fixed_k, args.method, args.prompt_lookup_min,
                             args.prompt_lookup_max, args.repeats, args.compute_thread)
    reason = why_not_runnable(proposer_config(settings, sweep_modes(settings.fixed_k)[-1]))
    if reason is not None:
        print(f"sweep: --method {args.method} cannot run here: {reason}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or available_cores())
    progress = stderr_progress()
    progress(f"loading {args.model}")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    workloads = build_workloads(loaded.tokenizer, args.num_prompts, args.max_tokens, args.edit_max_tokens)
    header = {
        "model": f"{loaded.model_id} ({loaded.dtype}, {loaded.device}), greedy, chat template",
        "machine": f"{platform.machine()}, {available_cores()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}",
        **describe_hardware(),
        "workloads": describe_workloads(workloads),
        "modes": describe_modes(settings),
        "sweep": f"concurrency {', '.join(map(str, settings.concurrency))}; {settings.repeats} round(s), "
        "medians across rounds",
        "metrics": "tok/s = output tokens / batch wall time (prefill included); ITL = median per-token gap "
        "between output chunks (a chunk's gap split over its tokens; time to first token left out)",
    }
    result = run_sweep(loaded.model, workloads, settings, sorted(loaded.eos_token_ids), header, progress)
    print(format_report(result), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.to_json(), handle, indent=2)
    if args.png:
        from services.bench.sweep_plot import draw_sweep

        draw_sweep(result.rows, args.png, title=f"{loaded.model_id}, {args.method}: adaptive vs fixed K vs none")
        progress(f"figure written to {args.png}")
    return 1 if result.failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
