"""Issue 29's HTTP rows: the whole stack on an accelerator, through the OpenAI API, captured steps against eager.

Run: `python -m services.bench.accelerator_http --device cuda --dtype bfloat16 [--modes captured eager]
[--loads 1 8 64] [--rounds R] [--lengths varied|equal]`. For each mode, the stack `specserve serve` starts (an
ngram drafter with K = 4, the verifier, the gateway; on free ports; eager adds `--enforce-eager`) comes up, and for
each load that many greedy
chat prompts go to POST /v1/completions at once, first without speculation, then with ngram, both per request on
the same stack (prefix caching off, so the second run does not find the first one's prompts cached). With
`--rounds R` each of the load's clients sends R requests, each as its last ends: a steady load, where one closed
batch ends on the rows that ran slowest (at 64 chats with ngram, the rows that never had a draft: speculation can
shorten the others but not the batch). Each request asks for its own number of tokens up to --max-tokens
(request_lengths.py: equal lengths keep a batch without speculation in lockstep; `--lengths equal` as before stop
75). Printed: each
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
from services.bench.request_lengths import add_lengths_argument, request_tokens
from services.bench.prompts import chat_token_ids
from services.eagle.chat_prompts import chat_prompt_messages
from services.gateway.tokenizer import load_tokenizer
from services.modeling.registry import DEFAULT_MODEL

MODES = ("captured", "eager")
K = NGRAM.num_speculative_tokens  # the in-process bench's drafter, so that the two read alike


def load_rate(client: HttpClient, prompts: Sequence[Sequence[int]], max_tokens: int, k: int,
              clients: int | None = None, varied: bool = False) -> float:
    """Completion tokens per second of `prompts` sent by `clients` clients at once (None: one a prompt), each
    sending its share one after another (K = 0: speculation off); `varied`: prompt i asks for
    request_tokens(i, max_tokens) tokens (request_lengths.py), else each for `max_tokens`."""
    clients = clients or len(prompts)

    def one_client(first: int) -> int:
        return sum(client.complete(prompts[i], request_tokens(i, max_tokens, varied), k).reported_tokens
                   for i in range(first, len(prompts), clients))

    with ThreadPoolExecutor(clients) as pool:
        started = time.perf_counter()
        tokens = sum(pool.map(one_client, range(clients)))
        seconds = time.perf_counter() - started
    return tokens / seconds


def run_mode(target: HttpTarget, mode: str, prompts_by_load: dict[int, list], max_tokens: int,
             progress, varied: bool = False) -> tuple[float, dict[int, tuple[float, float]]]:
    """(start-up seconds, per load: tok/s without speculation, with ngram K) of one stack; a load's prompts are
    sent by `load` clients (`varied`: load_rate's)."""
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
        rates = {load: tuple(load_rate(client, prompts, max_tokens, k, load, varied) for k in (0, K))
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
    parser.add_argument("--rounds", type=int, default=1,
                        help="requests each client of a load sends, each as its last ends (1: one closed batch)")
    parser.add_argument("--threads", type=int, default=None,
                        help="the verifier's torch threads (default: 1 on an accelerator, this machine's cores on CPU)")
    add_lengths_argument(parser)
    args = parser.parse_args(argv)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    tokenizer = load_tokenizer(args.model)
    chats = [chat_token_ids(tokenizer, m) for m in chat_prompt_messages()]
    prompts_by_load = {n: [chats[i % len(chats)] for i in range(n * args.rounds)] for n in args.loads}
    if args.rounds > 1:
        print(f"each client of a load sends {args.rounds} requests, each as its last ends")
    threads = args.threads or (torch.get_num_threads() if args.device == "cpu" else 1)
    target = HttpTarget(args.model, args.device, args.dtype, threads, tokenizer.decode)
    results = {}
    for mode in args.modes:
        startup, rates = run_mode(target, mode, prompts_by_load, args.max_tokens, lambda line: None,
                                  args.lengths == "varied")
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
