"""`specserve soak` / `python -m services.soak` / `make soak`: start `specserve serve` on free loopback ports,
drive it at saturation with a mix of good, cancelled and invalid requests for a bounded time, and check that
one request never harmed another: no failures other than clean 503s, the verifier idle again afterwards, and
no service's resident memory growing by more than 5% after the warm-up. Exit code 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.common.process_memory import resident_bytes
from services.launcher import default_serve_speculation
from services.soak.report import Memory, SoakReport, Targets, format_report, missed_targets
from services.soak.serve_process import ServeProcess
from services.soak.traffic import TrafficResult, TrafficSettings, drive

Children = Callable[[], dict[str, int]]  # service name -> pid, read when called
# Suffix decoding keeps each finished response in its global tree, up to 10,000 of them by default (about 9 KiB
# each on random tokens): the drafter's memory grows by design until then, which no soak's warm-up reaches (a
# 240 s soak read it as +11%). The soak caps that cache where its warm-up fills it, so that growth after the
# warm-up is a leak.
SOAK_CACHED_RESPONSES = 64


@dataclass(frozen=True)
class SoakSettings:
    traffic: TrafficSettings
    warmup_s: float = 60.0  # memory is measured from here: caches, allocator pools and JIT paths fill first
    drain_timeout_s: float = 60.0  # how long the verifier may take to be idle after the traffic stops
    targets: Targets = field(default_factory=Targets)


def memory_snapshot(children: Children) -> dict[str, tuple[int, int | None]]:
    """service -> (pid, VmRSS bytes)."""
    return {name: (pid, resident_bytes(pid)) for name, pid in children().items()}


async def _verifier_load(base_url: str) -> tuple[int | None, int | None]:
    """(running, waiting) requests of the verifier, from the gateway's /health; None when it does not say."""
    async with httpx.AsyncClient(timeout=10) as client:
        try:
            body = (await client.get(f"{base_url}/health")).json()
        except (httpx.HTTPError, ValueError):
            return None, None
    return body.get("num_running"), body.get("num_waiting")


async def _drain(base_url: str, timeout_s: float) -> tuple[int | None, int | None]:
    """Wait for the verifier to have nothing running or waiting (requests cancelled by their clients are freed
    at its next step); the last reading when it never gets there."""
    deadline = time.monotonic() + timeout_s
    load = await _verifier_load(base_url)
    while load != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        load = await _verifier_load(base_url)
    return load


async def soak(base_url: str, children: Children, settings: SoakSettings,
               progress: Callable[[str], None] = lambda line: None) -> SoakReport:
    """Drive an already running stack and build the report; memory is read after `warmup_s` of traffic and
    after the drain."""
    traffic = asyncio.create_task(drive(base_url, settings.traffic))
    await asyncio.wait({traffic}, timeout=settings.warmup_s)
    start = memory_snapshot(children)
    progress(f"warm-up over: {', '.join(f'{n} {(b or 0) / 2**20:.0f} MiB' for n, (_, b) in start.items())}")
    result: TrafficResult = await traffic
    progress(f"traffic over: {sum(result.outcomes.values())} requests in {result.elapsed_s:.0f} s; draining")
    running, waiting = await _drain(base_url, settings.drain_timeout_s)
    end = memory_snapshot(children)
    memory = [Memory(name, *start.get(name, (None, None)), *end.get(name, (None, None)))
              for name in sorted(set(start) | set(end), key=["drafter", "verifier", "gateway"].index)]
    return SoakReport.build(result, memory, running, waiting)


def soak_speculation(given: str | None) -> str:
    """The --speculative-config the soak serves with: the one given, else serve's default, with suffix decoding's
    response cache capped at SOAK_CACHED_RESPONSES unless the config sets it."""
    spec = json.loads(given or default_serve_speculation())
    if spec.get("method") == "suffix":
        spec.setdefault("suffix_decoding_max_cached_requests", SOAK_CACHED_RESPONSES)
    return json.dumps(spec)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve soak", description=__doc__.split("\n\n")[0])
    defaults = TrafficSettings()
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s, help="traffic time")
    parser.add_argument("--max-requests", type=int, default=defaults.max_requests, help="request budget")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency,
                        help="requests kept in flight (more than --max-num-seqs saturates the verifier)")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="memory baseline after this much traffic (default: a tenth of the duration, <= 60 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculative-config", default=None,
                        help="serve's, as JSON (default: serve's default drafter; suffix decoding's response cache "
                        f"capped at {SOAK_CACHED_RESPONSES} unless given, so that it is full after the warm-up)")
    parser.add_argument("--json-report", type=Path, default=None, help="also write the report here as JSON")
    parser.add_argument("--log-file", type=Path, default=None, help="the stack's output (default: a temp file)")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> SoakSettings:
    traffic = TrafficSettings(duration_s=args.duration_s, max_requests=args.max_requests,
                              concurrency=args.concurrency, max_tokens=args.max_tokens,
                              request_timeout_s=args.request_timeout_s, seed=args.seed, model=args.model)
    warmup = args.warmup_s if args.warmup_s is not None else min(60.0, args.duration_s / 10)
    return SoakSettings(traffic=traffic, warmup_s=warmup)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    log_path = args.log_file or Path(tempfile.mkdtemp(prefix="specserve-soak-")) / "serve.log"

    def progress(line: str) -> None:
        print(f"[soak {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    speculation = soak_speculation(args.speculative_config)
    stack = ServeProcess(log_path, model=args.model, device=args.device, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs, extra_flags=["--speculative-config", speculation])
    progress(f"starting specserve serve on {stack.base_url} (log: {log_path}; speculation {speculation})")
    try:
        stack.start()
        progress(f"stack healthy; {settings.traffic.concurrency} clients for {settings.traffic.duration_s:.0f} s")
        report = asyncio.run(soak(stack.base_url, stack.children, settings, progress))
    except (RuntimeError, TimeoutError) as error:
        progress(f"the stack did not come up: {error}")
        return 1
    finally:
        code = stack.stop()
        progress(f"specserve serve stopped (exit code {code})")
    missed = missed_targets(report, settings.targets)
    print(format_report(report, missed), flush=True)
    if args.json_report:
        args.json_report.write_text(json.dumps({**report.to_dict(), "missed_targets": missed}, indent=2))
    return 1 if missed else 0
