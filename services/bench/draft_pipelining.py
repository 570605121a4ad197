"""`python -m services.bench.draft_pipelining`: pipelined drafting against plain drafting, as a user deploys it.

`specserve serve --model TARGET --speculative-config '{"method": "draft_model", ..., "draft_pipelining": B}'` with
the verifier and the drafter on CPU sets of their own (`--verifier-cpus`, `--drafter-cpus`: the issue's "as on
separate hardware"), greedy HumanEval chats through the HTTP API, one at a time or `--concurrency` at once, the
same prompts for both settings. Prints the hardware, tokens/s per prompt and their median for each setting, the ratio, the pre-drafts
used and discarded (the drafter's metrics), and whether every output was identical (exit 1 if not).

    python -m services.bench.draft_pipelining [--target qwen2.5-coder-1.5b-instruct]
        [--draft qwen2.5-coder-0.5b-instruct] [--verifier-cpus 0] [--drafter-cpus 1] [--prompts 3]
        [--concurrency 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from services.bench.hardware import describe_hardware
from services.bench.prompts import humaneval_messages
from services.supervision import free_ports

HOST = "127.0.0.1"


def serve(args: argparse.Namespace, pipelining: bool, log: Path) -> tuple[subprocess.Popen, str, str]:
    """A `specserve serve` stack on free ports; (process, gateway URL, drafter metrics URL)."""
    port, verifier, drafter, verifier_metrics, drafter_metrics = free_ports(5, HOST)
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
            "draft_pipelining": pipelining}
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", args.target, "--speculative-config",
            json.dumps(spec), "--verifier-cpus", args.verifier_cpus, "--drafter-cpus", args.drafter_cpus,
            "--port", str(port), "--verifier-port", str(verifier), "--drafter-port", str(drafter),
            "--verifier-metrics-port", str(verifier_metrics), "--drafter-metrics-port", str(drafter_metrics),
            "--kv-cache-memory-bytes", args.kv_cache_memory_bytes, "--max-model-len", str(args.max_model_len),
            "--no-adaptive-speculation"]
    # a draft model on a core of its own takes longer than the default 0.5 s draft deadline for K tokens: the
    # verifier waits for it (both settings alike), or it would verify without drafts
    env = {**os.environ, "SPECSERVE_VERIFIER_DRAFT_TIMEOUT_S": str(args.draft_timeout_s),
           "SPECSERVE_VERIFIER_MAX_DRAFT_TIMEOUT_S": str(args.draft_timeout_s)}
    process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://{HOST}:{port}"
    deadline = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specserve serve exited ({process.returncode}); see {log}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return process, base, f"http://{HOST}:{drafter_metrics}/metrics"
        except httpx.HTTPError:
            pass
        time.sleep(2)
    process.terminate()
    raise RuntimeError(f"the stack did not become healthy in {args.start_timeout_s} s; see {log}")


def counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


def chat(client: httpx.Client, base: str, args: argparse.Namespace, message: str) -> dict:
    body = {"model": args.target, "messages": [{"role": "user", "content": message}],
            "max_tokens": args.max_tokens, "temperature": 0}
    started = time.perf_counter()
    reply = client.post(f"{base}/v1/chat/completions", json=body).json()
    seconds = time.perf_counter() - started
    return {"text": reply["choices"][0]["message"]["content"],
            "tok_s": reply["usage"]["completion_tokens"] / seconds, "speculation": reply["speculative_decoding"]}


def run(args: argparse.Namespace, pipelining: bool, messages: list[str], log: Path) -> dict:
    """Each prompt alone, or with --concurrency > 1, groups of that many prompts sent at once (per-request tok/s;
    a group's requests share the verifier's steps)."""
    process, base, drafter_metrics = serve(args, pipelining, log)
    try:
        client = httpx.Client(timeout=1800)
        results = []
        with ThreadPoolExecutor(args.concurrency) as pool:
            for start in range(0, len(messages), args.concurrency):
                group = messages[start : start + args.concurrency]
                results += list(pool.map(lambda message: chat(client, base, args, message), group))
        metrics = httpx.get(drafter_metrics).text
        used = counter(metrics, "specserve_drafter_predrafts_used_total")
        discarded = counter(metrics, "specserve_drafter_predrafts_discarded_total")
        hidden = counter(metrics, "specserve_drafter_predraft_hidden_seconds_total")
        return {"results": results, "used": used, "discarded": discarded, "hidden_s": hidden}
    finally:
        process.terminate()
        process.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=3, help="HumanEval problems")
    parser.add_argument("--concurrency", type=int, default=1, help="requests sent at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    parser.add_argument("--verifier-cpus", default=",".join(map(str, cpus[:half])))
    parser.add_argument("--drafter-cpus", default=",".join(map(str, cpus[half:] or cpus[:1])))
    parser.add_argument("--kv-cache-memory-bytes", default="1GiB")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--draft-timeout-s", type=float, default=5.0)
    parser.add_argument("--start-timeout-s", type=float, default=900)
    args = parser.parse_args(argv)
    print(json.dumps(describe_hardware()))
    print(f"verifier CPUs {args.verifier_cpus}, drafter CPUs {args.drafter_cpus}; {args.target} with "
          f"{args.draft} drafting K = {args.k} (adaptive speculation off), {args.prompts} HumanEval chats, "
          f"{args.max_tokens} tokens, greedy, {args.concurrency} at a time", flush=True)
    messages = humaneval_messages(args.prompts)
    logs = Path(tempfile.mkdtemp(prefix="specserve-pipelining-"))
    runs = {on: run(args, on, messages, logs / f"serve-{'on' if on else 'off'}.log") for on in (False, True)}
    for on, result in runs.items():
        speeds = [r["tok_s"] for r in result["results"]]
        print(f"pipelining {'on ' if on else 'off'}: tok/s per prompt {[round(s, 2) for s in speeds]}, median "
              f"{statistics.median(speeds):.2f}; pre-drafts used {result['used']:.0f}, discarded "
              f"{result['discarded']:.0f}, drafting hidden {result['hidden_s']:.1f} s")
    off = statistics.median(r["tok_s"] for r in runs[False]["results"])
    on = statistics.median(r["tok_s"] for r in runs[True]["results"])
    same = [a["text"] for a in runs[False]["results"]] == [b["text"] for b in runs[True]["results"]]
    print(f"pipelined / plain: {on / off:.2f}x; outputs identical: {same}; logs in {logs}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
