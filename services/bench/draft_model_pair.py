"""`python -m services.bench.draft_model_pair` (`make bench-draft-model`): a target and its draft model, specserve
against transformers' own assisted generation.

The pair is the issue's: Qwen2.5-Coder-1.5B-Instruct as the target, Qwen2.5-Coder-0.5B-Instruct as the draft model,
HumanEval prompts, greedy. One run measures, side by side and in rounds (each round runs every system once, so a
noisy spell on a shared machine hits a whole round rather than one system):

- transformers `generate`, plain and with the draft model as `assistant_model` at each K (constant schedule);
- specserve without speculation, with the draft_model drafter at each fixed K (adaptive speculation off) and with
  adaptive speculation (K <= the largest), at 1 request and at `concurrency` requests at once. The drafter runs as
  it is deployed: a `specserve drafter --method draft_model` process, reached over gRPC by the bench's in-process
  engine (the verifier's own engine, fed through its public API);
- then the whole stack as `specserve serve --model TARGET --speculative-config '{"method": "draft_model", ...}'`
  through the HTTP API, 1 request at a time, off and adaptive, and the resident memory of its verifier and
  drafter processes.

Every module is imported at start-up: the run takes most of an hour, and a module imported halfway through would
be whatever the checkout holds by then.

Every specserve output with speculation must equal specserve's output without it (exit code 1 otherwise).
Targets (the issue): specserve draft_model, best setting, >= 1.25x transformers assisted generation at its best K
and >= 1.3x specserve without speculation at 1 request; at `concurrency` requests, adaptive never below none.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.bench import available_cores, stderr_progress
from services.bench.drafter_process import drafter_process
from services.bench.hardware import describe_hardware
from services.bench.http_runs import HttpClient
from services.bench.prompts import chat_token_ids, humaneval_messages
from services.bench.report import (
    Check,
    Generation,
    Measurement,
    Row,
    compare,
    format_checks,
    format_markdown,
    format_table,
    merge_rounds,
    summarize,
)
from services.bench.specserve_runs import RequestIds, generate_one, run_concurrent
from services.bench.transformers_baseline import count_forwards
from services.common.main_thread_compute import run_with_compute, worker_thread
from services.common.process_memory import resident_bytes
from services.modeling.compute_placement import choose_compute_thread
from services.modeling.loading import load_model
from services.modeling.runner import ModelRunner
from services.modeling.runner_factory import create_runner
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from services.soak.serve_process import ServeProcess
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig

Progress = Callable[[str], None]
WARMUP_TOKENS = 8
TARGET_VS_ASSISTED = 1.25  # best specserve draft_model / best transformers assisted generation, 1 request
TARGET_VS_OFF = 1.3  # best specserve draft_model / specserve without speculation, 1 request
TARGET_CONCURRENT = 1.0  # adaptive / without speculation, at `concurrency` requests


@dataclass(frozen=True)
class PairSettings:
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str = "qwen2.5-coder-0.5b-instruct"
    device: str = "cpu"
    dtype: str = "float32"
    num_prompts: int = 4
    max_tokens: int = 96
    ks: tuple[int, ...] = (2, 3, 4, 5)
    concurrency: int = 4
    repeats: int = 2
    http: bool = True
    compute_thread: str = "auto"

    @property
    def max_k(self) -> int:
        return max(self.ks)


def row_keys(ks: Sequence[int]) -> dict[str, list[str]]:
    """Row keys by family; `dm{K}-1` is draft_model at fixed K, 1 request; `-N` at the concurrency."""
    return {
        "assisted": [*(f"hf-assist-{k}" for k in ks), "hf-assist-default"],
        "draft_model-1": [*(f"dm{k}-1" for k in ks), "dm-adaptive-1"],
        "draft_model-N": [*(f"dm{k}-N" for k in ks), "dm-adaptive-N"],
    }


def row_order(key: str, ks: Sequence[int]) -> int:
    """Table order: transformers, specserve at 1 request, the HTTP rows, then specserve concurrent."""
    families = row_keys(ks)
    order = ["hf-plain", *families["assisted"], "off-1", *families["draft_model-1"], "http-off-1",
             "http-dm-adaptive-1", "off-N", *families["draft_model-N"]]
    return order.index(key) if key in order else len(order)


# -- transformers ------------------------------------------------------------------------------------------------


# transformers reads the assistant's settings from the assistant model's own generation config (keyword arguments
# to `generate` do not reach it); its defaults: 20 tokens a round, cut short where the draft model's confidence
# falls below 0.4. A fixed K sets num_assistant_tokens = K with the confidence cut kept; "default" changes nothing.
ASSISTANT_DEFAULT = "default"


@contextlib.contextmanager
def assistant_tokens(draft, k: int | str):
    """The draft model's generation config set for K tokens a round (constant schedule), restored afterwards."""
    config = draft.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule)
    if k != ASSISTANT_DEFAULT:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
    try:
        yield
    finally:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved


def transformers_generate(
    target, draft, prompt: Sequence[int], max_tokens: int, eos: Sequence[int], k: int | str
) -> Generation:
    """One timed greedy `generate`; k = 0 plain, otherwise `draft` as the assistant with K tokens a round (or the
    transformers default)."""
    input_ids = torch.tensor([list(prompt)])
    kwargs = {"assistant_model": draft} if k else {}
    with assistant_tokens(draft, k), count_forwards(target) as calls, torch.inference_mode():
        started = time.perf_counter()
        output = target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=list(eos), pad_token_id=eos[0], **kwargs,
        )
        seconds = time.perf_counter() - started
    tokens = tuple(output[0, input_ids.shape[1]:].tolist())
    # Target forwards: each verifies a round of drafts and yields 1 + accepted tokens; so the "drafts" are the
    # forwards and the accepted tokens the rest, which makes mean acceptance length = tokens per target forward.
    drafts = calls[0] if k else 0
    return Generation(tokens, seconds, calls[0], drafts, len(tokens) - drafts if k else 0)


def measure_transformers(target, draft, prompts, settings: PairSettings, eos, progress) -> list[Measurement]:
    out = []
    for k in (0, *settings.ks, ASSISTANT_DEFAULT):
        if k == 0:
            key, system = "hf-plain", "transformers generate"
        elif k == ASSISTANT_DEFAULT:
            key, system = "hf-assist-default", "transformers assisted, its defaults (<=20, confidence cut)"
        else:
            key, system = f"hf-assist-{k}", f"transformers assisted K={k}"
        transformers_generate(target, draft, prompts[0], WARMUP_TOKENS, eos, k)
        runs = []
        for i, prompt in enumerate(prompts):
            run = transformers_generate(target, draft, prompt, settings.max_tokens, eos, k)
            progress(f"  {system}, prompt {i + 1}/{len(prompts)}: {len(run.tokens)} tokens in {run.seconds:.1f} s")
            runs.append(run)
        out.append(Measurement(key, "humaneval", system, 1, (tuple(runs),), speculative=k != 0))
    return out


# -- specserve in-process engine, draft_model drafter as a process ----------------------------------------------


def drafter_args(settings: PairSettings, max_model_len: int) -> list[str]:
    """`specserve drafter --method draft_model` for the pair's draft model."""
    return ["--method", "draft_model", "--model", settings.draft, "--device", settings.device, "--dtype",
            settings.dtype, "--num-speculative-tokens", str(settings.max_k), "--max-num-seqs",
            str(settings.concurrency), "--max-model-len", str(max_model_len)]


async def measure_specserve(
    runner: ModelRunner, compute: Executor, prompts, settings: PairSettings, eos, drafter_address: str,
    fingerprint: str, progress: Progress,
) -> list[Measurement]:
    ids = RequestIds()
    out = []
    n = settings.concurrency
    for adaptive in (False, True):
        config = EngineConfig(log_stats_interval_s=0, adaptive_speculation=adaptive, profile_step_cost=adaptive)
        link = RemoteProposerConfig(drafter_address, runner.vocab_size, fingerprint, step_timeout_s=None)  # as served
        proposer = RemoteProposer(link, method="draft_model")
        engine = Engine(runner, config, {"draft_model": proposer}, eos, compute)
        modes = [("dm-adaptive", f"specserve draft_model adaptive K<={settings.max_k}", settings.max_k)] if adaptive \
            else [("off", "specserve off", 0), *((f"dm{k}", f"specserve draft_model K={k}", k) for k in settings.ks)]
        try:
            async with engine:
                for key, system, k in modes:
                    method = "draft_model" if k else None
                    await generate_one(engine, ids.next("warmup"), prompts[0], WARMUP_TOKENS, method, k)
                    runs = []
                    for i, prompt in enumerate(prompts):
                        run = await generate_one(engine, ids.next("seq"), prompt, settings.max_tokens, method, k)
                        progress(f"  {system}, prompt {i + 1}/{len(prompts)}: {len(run.tokens)} tokens in "
                                 f"{run.seconds:.1f} s")
                        runs.append(run)
                    out.append(Measurement(f"{key}-1", "humaneval", system, 1, (tuple(runs),), speculative=k > 0))
                for key, system, k in modes:
                    method = "draft_model" if k else None
                    progress(f"  {system}, {n} concurrent")
                    batch, wall = await run_concurrent(engine, ids, prompts, settings.max_tokens, method, k, n, progress)
                    out.append(Measurement(f"{key}-N", "humaneval", system, n, (batch,), (wall,), speculative=k > 0))
        finally:
            await proposer.close()
    return out


def run_in_process(target, draft, prompts, settings: PairSettings, max_model_len: int, header: dict[str, str],
                   progress: Progress) -> tuple[list[Measurement], int]:
    """Every round of transformers and the in-process engine; returns the merged measurements and the drafter
    process's resident memory at the end."""
    eos = sorted(target.eos_token_ids)
    fingerprint = tokenizer_fingerprint(target.tokenizer)
    runner = create_runner(target.model, settings.concurrency, max_model_len)
    rounds = []
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(worker_thread())
        placement, timing = choose_compute_thread(settings.compute_thread, runner, worker)
        header["specserve compute thread"] = placement + (f" ({timing.describe()})" if timing else " (forced)")
        address, drafter_pid = stack.enter_context(drafter_process(drafter_args(settings, max_model_len), progress))
        for number in range(settings.repeats):
            progress(f"round {number + 1}/{settings.repeats}: transformers")
            measurements = measure_transformers(target.model, draft.model, prompts, settings, eos, progress)
            progress(f"round {number + 1}/{settings.repeats}: specserve")
            measurements += run_with_compute(placement, worker, lambda compute: measure_specserve(
                runner, compute, prompts, settings, eos, address, fingerprint, progress))
            rounds.append(measurements)
        drafter_rss = resident_bytes(drafter_pid) or 0
    return merge_rounds(rounds), drafter_rss


# -- the whole stack through the HTTP API -----------------------------------------------------------------------


def measure_http(settings: PairSettings, prompts, max_model_len: int, progress: Progress):
    """`specserve serve` with the draft_model method; 1 request at a time, off and adaptive. Returns the
    measurements and the resident memory (bytes) of its verifier and drafter after the requests."""
    spec = {"method": "draft_model", "model": settings.draft, "num_speculative_tokens": settings.max_k,
            "draft_max_num_seqs": settings.concurrency, "max_model_len": max_model_len,
            "draft_device": settings.device, "draft_dtype": settings.dtype}
    log = Path(tempfile.mkdtemp(prefix="specserve-bench-serve-")) / "serve.log"
    stack = ServeProcess(log, model=settings.target, device=settings.device, max_model_len=max_model_len,
                         max_num_seqs=settings.concurrency,
                         extra_flags=["--dtype", settings.dtype, "--speculative-config", json.dumps(spec)])
    started = time.perf_counter()
    try:
        stack.start(timeout_s=900)
        progress(f"specserve serve healthy after {time.perf_counter() - started:.0f} s (log {log})")
        out = []
        with HttpClient(stack.base_url) as client:
            adaptive = f"specserve serve, HTTP API, draft_model adaptive K<={settings.max_k}"
            for key, system, k in (("http-off-1", "specserve serve, HTTP API, off", 0),
                                   ("http-dm-adaptive-1", adaptive, settings.max_k)):
                client.complete(prompts[0], WARMUP_TOKENS, k, "draft_model")
                runs = []
                for i, prompt in enumerate(prompts):
                    run = client.complete(prompt, settings.max_tokens, k, "draft_model")
                    progress(f"  {system}, prompt {i + 1}/{len(prompts)}: {run.num_tokens} tokens in {run.seconds:.1f} s")
                    runs.append(run)
                out.append(Measurement(key, "humaneval", system, 1, (tuple(runs),), speculative=k > 0))
        memory = {name: resident_bytes(pid) or 0 for name, pid in stack.children().items()}
    finally:
        stack.stop()
    return out, memory


# -- report -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    target: float
    detail: str

    @property
    def met(self) -> bool:
        return self.value >= self.target


def best(rows: dict[str, Row], keys: Sequence[str]) -> Row | None:
    present = [rows[k] for k in keys if k in rows]
    return max(present, key=lambda r: r.tokens_per_s) if present else None


def targets(rows: Sequence[Row], ks: Sequence[int]) -> list[Target]:
    by_key = {r.key: r for r in rows}
    families = row_keys(ks)
    top, assisted = best(by_key, families["draft_model-1"]), best(by_key, families["assisted"])
    out = []
    if top and assisted:
        out.append(Target("specserve draft_model (best) / transformers assisted (best K), 1 request",
                          top.tokens_per_s / assisted.tokens_per_s, TARGET_VS_ASSISTED,
                          f"{top.system} vs {assisted.system}"))
    if top and "off-1" in by_key:
        out.append(Target("specserve draft_model (best) / specserve off, 1 request",
                          top.tokens_per_s / by_key["off-1"].tokens_per_s, TARGET_VS_OFF, top.system))
    if "dm-adaptive-N" in by_key and "off-N" in by_key:
        out.append(Target("specserve draft_model adaptive / specserve off, concurrent",
                          by_key["dm-adaptive-N"].tokens_per_s / by_key["off-N"].tokens_per_s, TARGET_CONCURRENT,
                          f"{by_key['off-N'].concurrency} requests"))
    return out


def equality_checks(measurements: Sequence[Measurement], ks: Sequence[int]) -> list[Check]:
    by_key = {m.key: m for m in measurements}
    families = row_keys(ks)
    plan = [(f"{key} vs off, 1 request", key, "off-1", True) for key in families["draft_model-1"]]
    plan += [(f"{key} vs off, concurrent", key, "off-N", True) for key in families["draft_model-N"]]
    plan += [("HTTP API draft_model vs HTTP API off (text)", "http-dm-adaptive-1", "http-off-1", True),
             ("specserve off vs transformers plain", "off-1", "hf-plain", False)]
    plan += [(f"{key} vs transformers plain", key, "hf-plain", False) for key in families["assisted"]]
    return [compare(name, "humaneval", by_key[a], by_key[b], required)
            for name, a, b, required in plan if a in by_key and b in by_key]


def format_targets(found: Sequence[Target]) -> str:
    return "\n".join(f"{t.name}: {t.value:.3f}x (target >= {t.target:.2f}) {'MET' if t.met else 'NOT MET'}"
                     f" [{t.detail}]" for t in found)


# -- command line -------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> tuple[PairSettings, str | None]:
    defaults = PairSettings()
    parser = argparse.ArgumentParser(prog="python -m services.bench.draft_model_pair",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=defaults.target)
    parser.add_argument("--draft", default=defaults.draft)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts, help="HumanEval problems")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--k", type=int, nargs="+", default=list(defaults.ks), help="fixed K values")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="rounds over every system")
    parser.add_argument("--no-http", dest="http", action="store_false", help="skip the `specserve serve` rows")
    parser.add_argument("--compute-thread", choices=["auto", "main", "worker"], default="auto")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if min(args.k) < 1 or args.concurrency < 1 or args.repeats < 1 or args.num_prompts < 1:
        parser.error("--k, --concurrency, --repeats and --num-prompts must be >= 1")
    return PairSettings(args.target, args.draft, args.device, args.dtype, args.num_prompts, args.max_tokens,
                        tuple(sorted(set(args.k))), args.concurrency, args.repeats, args.http, args.compute_thread), args.json


def main(argv: Sequence[str] | None = None) -> int:
    settings, json_path = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(available_cores())
    progress = stderr_progress()
    progress(f"loading {settings.target} and {settings.draft}")
    target = load_model(settings.target, device=settings.device, dtype=settings.dtype)
    draft = load_model(settings.draft, device=settings.device, dtype=settings.dtype)
    prompts = [chat_token_ids(target.tokenizer, m) for m in humaneval_messages(settings.num_prompts)]
    max_model_len = max(map(len, prompts)) + settings.max_tokens + settings.max_k + 2
    header = {
        "target": f"{target.model_id} ({target.dtype}, {target.device})",
        "draft model": f"{draft.model_id} ({draft.dtype}, {draft.device})",
        "machine": f"{platform.machine()}, {available_cores()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}",
        **describe_hardware(),
        "workload": f"HumanEval, {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(chat template), greedy, max {settings.max_tokens} new tokens; {settings.repeats} round(s)",
        "transformers assisted": "generate(assistant_model=draft), greedy, the draft model's generation config "
        "set to num_assistant_tokens=K, schedule 'constant' (its confidence cut at 0.4 kept), or left at the "
        "transformers defaults; acceptance length = tokens per target forward",
        "tok/s": "1 request: median over prompts of per-prompt tok/s; concurrent: aggregate over the batch",
    }
    measurements, drafter_rss = run_in_process(target, draft, prompts, settings, max_model_len, header, progress)
    memory = {"drafter process (in-process rows)": drafter_rss}
    target = draft = None  # the `specserve serve` stack below needs the memory
    gc.collect()
    if settings.http:
        http_measurements, serve_memory = measure_http(settings, prompts, max_model_len, progress)
        measurements += http_measurements
        memory |= {f"specserve serve {name}": rss for name, rss in serve_memory.items()}
    header["resident memory"] = ", ".join(f"{name} {rss / 2**30:.2f} GiB" for name, rss in memory.items())
    rows = sorted((summarize(m) for m in measurements), key=lambda r: row_order(r.key, settings.ks))
    found = targets(rows, settings.ks)
    checks = equality_checks(measurements, settings.ks)
    failed = sum(c.mismatches for c in checks if c.required)
    report = ["== specserve draft_model benchmark ==", *(f"{k}: {v}" for k, v in header.items()), "",
              format_table(rows), "", "== targets ==", format_targets(found), "", "== greedy equality ==",
              format_checks(checks), "", "== markdown ==", format_markdown(rows)]
    if failed:
        report.insert(-3, f"WARNING: {failed} output(s) differ where they must be identical")
    print("\n".join(report), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({
            "header": header, "rows": [asdict(r) for r in rows],
            "targets": [asdict(t) | {"met": t.met} for t in found],
            "checks": [asdict(c) for c in checks], "memory_bytes": memory,
        }, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
