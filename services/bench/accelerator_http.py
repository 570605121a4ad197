"""Issue 29's HTTP rows: the whole stack on an accelerator, through the OpenAI API, captured steps against eager.

Run: `python -m services.bench.accelerator_http --device cuda --dtype bfloat16 [--modes captured eager]
[--loads 1 8 64]`. For each mode, the stack `specserve serve` starts (an ngram drafter with K = 4, the verifier,
the gateway; on free ports; eager adds `--enforce-eager`) comes up, and for each load that many greedy chat
prompts go to POST /v1/completions at once, first without speculation, then with ngram, both per request on the
same stack (prefix caching off, so the second run does not find the first one's prompts cached). Printed: each
stack's start-up seconds (graph capture included), tokens/s of each load (completion tokens over the load's wall
time, HTTP round trips included) without and with speculation and their ratio, then captured against eager.
accelerator_step.py measures the same engine in process, with the step taken apart; this is what a client sees.
On CPU both modes run the same eager forwards.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from services.bench.accelerator_step import NGRAM
from services.bench.hardware import describe_hardware
from services.bench.http_runs import HttpClient, HttpStack, HttpTarget, launcher_args
from services.bench.prompts import chat_token_ids
from services.eagle.chat_prompts import chat_prompt_messages
from services.gateway.tokenizer import load_tokenizer
from services.modeling.registry import DEFAULT_MODEL

MODES = ("captured", "eager")
K = NGRAM.num_speculative_tokens  # the in-process bench's drafter, so that the two read alike


def load_rate(client: HttpClient, prompts: Sequence[Sequence[int]], max_tokens: int, k: int) -> float:
    """Completion tokens per second of all `prompts` sent at once (K = 0: speculation off)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        started = time.perf_counter()
        generations = list(pool.map(lambda prompt: client.complete(prompt, max_tokens, k), prompts))
        seconds = time.perf_counter() - started
    return sum(g.reported_tokens for g in generations) / seconds


def run_mode(target: HttpTarget, mode: str, prompts_by_load: dict[int, list], max_tokens: int,
             progress) -> tuple[float, dict[int, tuple[float, float]]]:
    """(start-up seconds, per load: tok/s without speculation, with ngram K) of one stack."""
    lookup = NGRAM.options
    args = launcher_args(target, K, lookup.prompt_lookup_min, lookup.prompt_lookup_max, max(prompts_by_load), 2048,
                         "auto")
    args.enforce_eager = mode == "eager"
    args.enable_prefix_caching = False  # the ngram run follows the plain one over the same prompts
    started = time.perf_counter()
    with HttpStack(args, target.threads, progress) as stack, HttpClient(stack.base_url) as client:
        startup = time.perf_counter() - started
        load_rate(client, prompts_by_load[min(prompts_by_load)], 16, 0)  # warm-up, both ways
        load_rate(client, prompts_by_load[min(prompts_by_load)], 16, K)
        rates = {load: (load_rate(client, prompts, max_tokens, 0), load_rate(client, prompts, max_tokens, K))
                 for load, prompts in prompts_by_load.items()}
    return startup, rates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.accelerator_http",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--threads", type=int, default=None,
                        help="the verifier's torch threads (default: 1 on an accelerator, this machine's cores on CPU)")
    args = parser.parse_args(argv)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    tokenizer = load_tokenizer(args.model)
    chats = [chat_token_ids(tokenizer, m) for m in chat_prompt_messages()]
    prompts_by_load = {n: [chats[i % len(chats)] for i in range(n)] for n in args.loads}
    threads = args.threads or (torch.get_num_threads() if args.device == "cpu" else 1)
    target = HttpTarget(args.model, args.device, args.dtype, threads, tokenizer.decode)
    results = {}
    for mode in args.modes:
        startup, rates = run_mode(target, mode, prompts_by_load, args.max_tokens, lambda line: None)
        results[mode] = rates
        print(f"\n[{mode}] stack started in {startup:.0f} s", flush=True)
        for load, (plain, spec) in rates.items():
            print(f"  {load:3d} concurrent chats: none {plain:7.1f} tok/s, ngram K={K} {spec:7.1f} tok/s "
                  f"({spec / plain:.2f}x)", flush=True)
    if "captured" in results and "eager" in results:
        print("\ncaptured against eager, without speculation: " + ", ".join(
            f"{load}: {results['captured'][load][0] / results['eager'][load][0]:.2f}x" for load in args.loads)
            + (" (on CPU both run the same eager forward: these ratios are noise)" if args.device == "cpu" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
