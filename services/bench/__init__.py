"""`specserve bench`: specserve's engine against transformers `generate`, with and without n-gram speculation,
and the whole stack through its HTTP API against the engine in-process.

One run measures every row of the table and derives the target ratios from those same numbers, so a reader
never compares figures taken on different machines or at different times. Greedy outputs are compared while
benchmarking: a speculative output that differs from speculation off, or an HTTP output that differs from the
in-process engine's, fails the run (exit code 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from services.bench import http_runs, specserve_runs, transformers_baseline
from services.bench.forward_cost import describe_verify_cost
from services.bench.hardware import describe_hardware
from services.bench.http_runs import HttpTarget
from services.bench.prompts import MULTI_TURN_MAX_TURNS, Workload
from services.bench.report import (
    BenchResult,
    Check,
    Measurement,
    compare,
    format_report,
    merge_rounds,
    summarize,
)
from services.common.drafter_methods import why_not_runnable
from services.common.main_thread_compute import run_with_compute, worker_thread
from services.common.speculative_config import SpeculativeConfig
from services.modeling.compute_placement import choose_compute_thread
from services.modeling.registry import DEFAULT_MODEL
from services.modeling.runner import ModelRunner
from services.modeling.runner_factory import create_runner

__all__ = ["BenchSettings", "HttpTarget", "main", "run_benchmark"]

Progress = Callable[[str], None]
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class BenchSettings:
    k: int = 8  # draft tokens per step (ngram and transformers prompt lookup): best of a K=3..8 sweep
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    concurrency: int = 8
    repeats: int = 3  # rounds over every system; rows report medians across rounds
    compute_thread: str = "auto"  # thread for the engine's forwards, as the verifier's --compute-thread
    # The engine's default. Off only where a test counts drafts: with a tiny model, whether drafting pays (and so
    # whether any draft is verified) depends on the machine's timings.
    adaptive_speculation: bool = True


def measure_transformers(
    model: torch.nn.Module,
    workloads: Sequence[Workload],
    settings: BenchSettings,
    eos_token_ids: Sequence[int],
    progress: Progress,
) -> list[Measurement]:
    """One round of plain greedy generate, then prompt lookup with the same K and n-gram size as specserve."""
    measurements = []
    systems = (
        ("hf-plain", "transformers generate", None),
        ("hf-pld", f"transformers prompt lookup K={settings.k}", (settings.k, settings.prompt_lookup_max)),
    )
    for key, system, lookup in systems:
        progress(f"warm-up: {system}")
        warmup_prompt = workloads[0].prompts[0]
        transformers_baseline.generate_one(model, warmup_prompt, WARMUP_TOKENS, eos_token_ids, lookup)
        for w in workloads:
            progress(f"{w.name}: {system}")
            run = transformers_baseline.run_transformers(
                model, w.prompts, w.max_tokens, eos_token_ids, lookup, progress
            )
            measurements.append(Measurement(key, w.name, system, 1, (run,), speculative=lookup is not None))
    return measurements


@dataclass(frozen=True)
class Mode:
    """One way specserve runs in the table: speculation off, or a drafter method with its config."""

    key: str  # row key prefix: "off", "ngram", "suffix"
    label: str
    config: SpeculativeConfig | None = None  # None: speculation off

    @property
    def method(self) -> str | None:
        return self.config.method if self.config else None

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens if self.config else 0

    def http_k(self) -> int | None:
        """K for the HTTP rows, which the bench measures for off and ngram (the stack's drafter); None: no row."""
        return {"off": 0, "ngram": self.k}.get(self.key)


async def _sequential(engine, ids, workloads, settings, mode: Mode, progress, http=None) -> list[Measurement]:
    """One request at a time: the latency-bound case speculation is for. With `http` (a client on the stack),
    each prompt then goes through the HTTP API too, right after its in-process run: the two timings of a pair
    are seconds apart, so a noisy spell on a shared machine hits both rather than one (the ratio between them
    is a target). The HTTP request blocks this event loop, which has nothing to do then: no request is in
    flight in the in-process engine, and the stack's processes idle while the in-process engine runs."""
    http_k = mode.http_k() if http is not None else None
    progress(f"warm-up: {mode.label}")
    warmup = workloads[0].prompts[0]
    if mode.config:
        specserve_runs.fresh_proposer(engine, mode.config)
    await specserve_runs.generate_one(engine, ids.next("warmup"), warmup, WARMUP_TOKENS, mode.method, mode.k)
    if http_k is not None:
        progress(f"warm-up: {http_runs.system_label(http_k)}")
        http.complete(warmup, WARMUP_TOKENS, http_k)
    measurements = []
    for w in workloads:
        also = ", each prompt also through the HTTP API" if http_k is not None else ""
        progress(f"{w.name}: {mode.label}, 1 request at a time{also}")
        if mode.config:
            specserve_runs.fresh_proposer(engine, mode.config)  # a workload's prompts share one history
        local, remote = [], []
        for i, prompt in enumerate(w.prompts):
            result = await specserve_runs.generate_one(
                engine, ids.next("seq"), prompt, w.max_tokens, mode.method, mode.k
            )
            local.append(result)
            line = f"  prompt {i + 1}/{len(w.prompts)}: {len(result.tokens)} tokens in {result.seconds:.2f} s"
            if http_k is not None:
                over_http = http.complete(prompt, w.max_tokens, http_k)
                remote.append(over_http)
                line += f"; HTTP API: {over_http.num_tokens} tokens in {over_http.seconds:.2f} s"
            progress(line)
        key = f"{mode.key}-1"
        measurements.append(Measurement(key, w.name, mode.label, 1, (tuple(local),), speculative=mode.k > 0))
        if http_k is not None:
            measurements.append(Measurement(
                f"http-{key}", w.name, http_runs.system_label(http_k), 1, (tuple(remote),), speculative=http_k > 0
            ))
    return measurements


async def _concurrent(engine, ids, workloads, settings, mode: Mode, progress) -> list[Measurement]:
    """`concurrency` requests at once: the throughput case, one batched forward per step."""
    n = settings.concurrency
    measurements = []
    for w in workloads:
        progress(f"{w.name}: {mode.label}, {n} concurrent")
        if mode.config:
            specserve_runs.fresh_proposer(engine, mode.config)
        run, wall = await specserve_runs.run_concurrent(
            engine, ids, w.prompts, w.max_tokens, mode.method, mode.k, n, progress
        )
        measurements.append(Measurement(f"{mode.key}-N", w.name, mode.label, n, (run,), (wall,), speculative=mode.k > 0))
    return measurements


def specserve_modes(settings: BenchSettings, progress: Progress) -> list[Mode]:
    """Off, ngram and suffix with the same K; suffix only where its native package is installed (said so)."""
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=settings.k,
                              prompt_lookup_min=settings.prompt_lookup_min, prompt_lookup_max=settings.prompt_lookup_max)
    modes = [Mode("off", "specserve off"), Mode("ngram", f"specserve ngram K<={settings.k}", ngram)]
    suffix = SpeculativeConfig(method="suffix", num_speculative_tokens=settings.k)
    reason = why_not_runnable(suffix)
    if reason is not None:
        progress(f"no suffix rows: {reason}")
        return modes
    return [*modes, Mode("suffix", f"specserve suffix K<={settings.k}", suffix)]


def max_model_len(workloads: Sequence[Workload], settings: BenchSettings) -> int:
    """Positions per KV slot: the longest prompt plus the largest budget, and room for one step's drafts."""
    longest = max(len(p) for w in workloads for p in w.prompts) + max(w.max_tokens for w in workloads)
    return longest + settings.k + 2


async def measure_specserve(
    runner: ModelRunner,
    compute: Executor,
    workloads: Sequence[Workload],
    settings: BenchSettings,
    eos_token_ids: Sequence[int],
    progress: Progress,
    http: http_runs.HttpClient | None = None,
) -> list[Measurement]:
    """Speculation off, ngram and suffix, one request at a time and `concurrency` at once, all on one engine;
    with `http`, the single-request runs of off and ngram also through the HTTP API (see `_sequential`)."""
    engine = specserve_runs.build_engine(runner, eos_token_ids, compute, settings.adaptive_speculation)
    ids = specserve_runs.RequestIds()
    modes = specserve_modes(settings, progress)
    measurements = []
    async with engine:
        for mode in modes:
            measurements += await _sequential(engine, ids, workloads, settings, mode, progress, http)
        for mode in modes:
            measurements += await _concurrent(engine, ids, workloads, settings, mode, progress)
    return measurements


def equality_checks(measurements: Sequence[Measurement]) -> list[Check]:
    """Speculation must not change greedy output (required); transformers vs specserve is informational, since
    float reassociation in a differently shaped computation may legitimately flip a near-tie. The HTTP API must
    return what the in-process engine generates (required): the verifier runs the same model, dtype, runner
    shape, thread count and kernels on the same prompts, one request at a time, so nothing may differ. HTTP
    outputs are text, so those checks compare text and token count."""
    by_key = {(m.workload, m.key): m for m in measurements}
    workloads = dict.fromkeys(m.workload for m in measurements)
    plan = (
        ("specserve ngram vs off, 1 request", "ngram-1", "off-1", True),
        ("specserve ngram vs off, concurrent", "ngram-N", "off-N", True),
        ("specserve suffix vs off, 1 request", "suffix-1", "off-1", True),
        ("specserve suffix vs off, concurrent", "suffix-N", "off-N", True),
        ("HTTP API ngram vs HTTP API off, 1 request (text)", "http-ngram-1", "http-off-1", True),
        ("HTTP API ngram vs in-process ngram, 1 request (text)", "http-ngram-1", "ngram-1", True),
        ("HTTP API off vs in-process off, 1 request (text)", "http-off-1", "off-1", True),
        ("specserve off vs transformers plain", "off-1", "hf-plain", False),
        ("transformers prompt lookup vs plain", "hf-pld", "hf-plain", False),
    )
    checks = []
    for workload in workloads:
        for name, a, b, required in plan:
            if (workload, a) in by_key and (workload, b) in by_key:
                checks.append(compare(name, workload, by_key[workload, a], by_key[workload, b], required))
    return checks


def with_text(measurements: Sequence[Measurement], decode: Callable[[Sequence[int]], str]) -> list[Measurement]:
    """In-process single-request outputs decoded as the gateway decodes them, for comparison with HTTP ones."""
    out = []
    for m in measurements:
        if m.key in ("off-1", "ngram-1"):
            generations = tuple(
                tuple(dataclasses.replace(g, text=decode(g.tokens)) for g in repeat) for repeat in m.generations
            )
            m = dataclasses.replace(m, generations=generations)
        out.append(m)
    return out


def run_benchmark(
    model: torch.nn.Module,
    workloads: Sequence[Workload],
    settings: BenchSettings,
    eos_token_ids: Sequence[int],
    header: dict[str, str],
    progress: Progress,
    http: HttpTarget | None = None,
) -> BenchResult:
    """Every row of the table on already-tokenized workloads (the smoke test calls this with a tiny model).
    With `http`, the whole stack also serves `http.model` as processes (started once, before the first round)
    and every round measures it through the HTTP API too."""
    with contextlib.ExitStack() as stack:
        runner = create_runner(model, max_num_seqs=settings.concurrency, max_model_len=max_model_len(workloads, settings))
        worker = stack.enter_context(worker_thread())
        placement, timing = choose_compute_thread(settings.compute_thread, runner, worker)
        verify_cost = describe_verify_cost(runner, placement, worker, settings.k + 1)
        client = None
        if http is not None:  # its verifier uses the same placement, so the HTTP rows differ by the API alone
            client = stack.enter_context(start_http_stack(http, workloads, settings, progress, placement))
        # Each round runs every system once, so a noisy spell on a shared machine hits all systems of that
        # round rather than one system's every repeat; rows then take medians across rounds.
        rounds = []
        for number in range(settings.repeats):
            progress(f"round {number + 1}/{settings.repeats}")
            measurements = measure_transformers(model, workloads, settings, eos_token_ids, progress)
            specserve = run_with_compute(placement, worker, lambda compute: measure_specserve(
                runner, compute, workloads, settings, eos_token_ids, progress, client
            ))
            rounds.append(measurements + specserve)
    measurements = merge_rounds(rounds)
    if http is not None:
        measurements = with_text(measurements, http.decode)
    order = {w.name: i for i, w in enumerate(workloads)}
    measurements.sort(key=lambda m: order[m.workload])  # stable: keeps the system order within a workload
    header = {
        **header,
        "specserve kernels": getattr(runner, "kernels", type(runner).__name__),
        "specserve compute thread": placement + (f" ({timing.describe()})" if timing else " (forced)"),
        "specserve forward cost": verify_cost,
    }
    return BenchResult(header, [summarize(m) for m in measurements], equality_checks(measurements))


@contextlib.contextmanager
def start_http_stack(
    http: HttpTarget, workloads: Sequence[Workload], settings: BenchSettings, progress: Progress, compute_thread: str
):
    """Drafter, verifier and gateway configured like the in-process engine (K, n-gram sizes, slots, context
    length, compute thread); yields a client on the gateway and stops the processes afterwards, whatever
    happened."""
    args = http_runs.launcher_args(
        http, settings.k, settings.prompt_lookup_min, settings.prompt_lookup_max, settings.concurrency,
        max_model_len(workloads, settings), compute_thread,
    )
    started = time.perf_counter()
    with http_runs.HttpStack(args, http.threads, progress) as stack, http_runs.HttpClient(stack.base_url) as client:
        progress(f"HTTP stack serving {client.model} at {stack.base_url} (started in "
                 f"{time.perf_counter() - started:.0f} s)")
        yield client


# -- command line --------------------------------------------------------------------------------------------


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the host's count, inside containers)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=None, help="HumanEval problems (default 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="HumanEval max new tokens (default 128)")
    parser.add_argument("--edit-max-tokens", type=int, default=None,
                        help="code-edit, edit-sequence and multi-turn max new tokens (256)")
    parser.add_argument("--turns", type=int, default=None, help=f"multi-turn conversation turns, 1 to {MULTI_TURN_MAX_TURNS} (default 4)")
    parser.add_argument("--k", type=int, default=BenchSettings.k, help="speculative tokens per step")
    parser.add_argument("--prompt-lookup-min", type=int, default=BenchSettings.prompt_lookup_min)
    parser.add_argument("--prompt-lookup-max", type=int, default=BenchSettings.prompt_lookup_max)
    parser.add_argument("--concurrency", type=int, default=None, help="concurrent requests (default 8)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds over every system (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: available cores)")
    parser.add_argument("--compute-thread", choices=["auto", "main", "worker"], default="auto",
                        help="thread for specserve's forwards; auto measures both, as the verifier does")
    parser.add_argument("--quick", action="store_true", help="a tiny run that checks the setup")
    parser.add_argument(
        "--no-http", dest="http", action="store_false",
        help="skip the end-to-end rows (the whole stack as processes, through the HTTP API)",
    )
    parser.add_argument("--json", type=str, default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {  # (--quick, full run)
        "num_prompts": (2, 4),
        "max_tokens": (16, 128),
        "edit_max_tokens": (32, 256),
        "turns": (2, 4),
        "concurrency": (4, 8),
        "repeats": (1, BenchSettings.repeats),
    }
    for name, (quick_value, full_value) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick_value if quick else full_value)
    if not 1 <= args.turns <= MULTI_TURN_MAX_TURNS:
        parser.error(f"--turns must be 1 to {MULTI_TURN_MAX_TURNS}")
    return args


def stderr_progress() -> Progress:
    """Progress lines with elapsed time on stderr, so stdout holds only the report."""
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    return progress


def main(argv: Sequence[str] | None = None) -> int:
    from services.bench.prompts import build_workloads
    from services.gateway.tokenizer import make_decode
    from services.modeling.loading import load_model

    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads or available_cores())
    progress = stderr_progress()
    progress(f"loading {args.model}")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    # The verifier's own EOS set (generation config, model config and tokenizer), so in-process and HTTP runs
    # stop on the same tokens.
    eos_token_ids = sorted(loaded.eos_token_ids)

    def greedy(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        return transformers_baseline.generate_one(loaded.model, prompt, max_tokens, eos_token_ids).tokens

    if args.turns > 1:
        progress(f"multi-turn: generating the answers to the first {args.turns - 1} of {args.turns} turns")
    workloads = build_workloads(
        loaded.tokenizer, args.num_prompts, args.max_tokens, args.edit_max_tokens, greedy, args.turns
    )
    settings = BenchSettings(
        args.k, args.prompt_lookup_min, args.prompt_lookup_max, args.concurrency, args.repeats,
        args.compute_thread,
    )
    header = {
        "model": f"{loaded.model_id} ({loaded.dtype}, {loaded.device}), greedy, chat template",
        "machine": f"{platform.machine()}, {available_cores()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}",
        **describe_hardware(),
        "workloads": ", ".join(
            f"{w.name}: {len(w.prompts)} prompt(s) of {min(map(len, w.prompts))}-{max(map(len, w.prompts))} "
            f"tokens, max {w.max_tokens} new"
            for w in workloads
        ),
        "multi-turn": f"{args.turns} turns; each prompt holds the conversation so far, the earlier answers "
        "generated once, greedy, by transformers generate before the first round",
        "speculation": f"ngram and suffix K<={args.k} (adaptive speculation, the engine's default, picks K per step; "
        f"python -m services.bench.sweep compares fixed K), prompt_lookup_min={args.prompt_lookup_min}, "
        f"prompt_lookup_max={args.prompt_lookup_max}; concurrency {args.concurrency}; repeats {args.repeats}",
        "tok/s": "single-request rows: median over prompts of per-prompt tok/s; concurrent rows: aggregate",
    }
    http = None
    if args.http:
        header["HTTP API"] = (
            "drafter + verifier + gateway as processes (the `specserve serve` commands, same model, dtype, K, "
            "slots and threads); POST /v1/completions with the token-id prompt, non-streaming, 1 request at a "
            "time; tok/s = usage.completion_tokens / request wall time; outputs compared as text + token count"
        )
        http = HttpTarget(args.model, args.device, args.dtype, torch.get_num_threads(), make_decode(loaded.tokenizer))
    try:
        result = run_benchmark(loaded.model, workloads, settings, eos_token_ids, header, progress, http)
    except http_runs.StackError as error:
        print(f"specserve bench: {error}\n(--no-http skips the HTTP API rows)", file=sys.stderr)
        return 2
    print(format_report(result), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.to_json(), handle, indent=2)
    return 1 if result.failed_checks else 0
