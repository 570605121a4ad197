"""Suffix decoding (or, with --method ngram, prompt lookup) with token trees vs chains (and no speculation), side
by side in one run (`make bench-trees`).

The same in-process engine (the verifier's, in-process proposers) serves each workload in every mode, the modes
interleaved round by round: no speculation; the suffix chain of K tokens and the suffix tree of up to N tokens
(num_draft_tokens) no deeper than K (the same depth); the chain of N tokens and the tree of N tokens at any
depth (the same verify width). Workloads: the edit sequence (one file edited several times in a row, each
answer the whole file: a tree holds the branches where earlier answers differ) and the multi-turn conversation,
at 1 request and at a batch of concurrent requests. An unmeasured pass first puts the prompts in the prefix
cache. Each mode starts from a fresh proposer, then runs every prompt of the workload in order, so later prompts
draft from earlier answers as in a session. Prints tok/s, mean accepted tokens per verified draft and the
ratios, medians of rounds; exits 1 if any speculative output differs from no speculation (greedy).

    python -m services.bench.suffix_trees [--model smollm2-135m-instruct] [--method suffix] [--k 5] [--nodes 12]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from services.bench import transformers_baseline
from services.bench.hardware import describe_hardware
from services.bench.prompts import build_workloads
from services.bench.specserve_runs import RequestIds, build_engine
from services.common.drafter_methods import build_proposer
from services.common.method_options import SuffixOptions
from services.common.speculative_config import SpeculativeConfig
from services.modeling.loading import load_model
from services.modeling.runner_factory import create_runner
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams

WORKLOADS = ("edit-sequence", "multi-turn")


async def run_mode(engine, ids: RequestIds, prompts, max_tokens: int, mode: dict | None, concurrency: int,
                   method: str = "suffix"):
    """Every prompt in order (`concurrency` copies of each at once); returns (tokens per prompt, seconds,
    drafts, accepted)."""
    spec = SpeculationParams()
    if mode is not None:
        config = SpeculativeConfig.model_validate({"method": method, **mode})
        engine.proposers[method] = build_proposer(config)
        spec = SpeculationParams(method, config.verify_width)
    outputs, seconds, drafts, accepted = [], 0.0, 0, 0
    for prompt in prompts:
        requests = [GenerationRequest(ids.next("t"), tuple(prompt), SamplingParams(max_tokens=max_tokens,
                                                                                    temperature=0.0), spec)
                    for _ in range(concurrency)]
        started = time.perf_counter()
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        seconds += time.perf_counter() - started
        outputs.append([tokens for tokens, _ in results])
        for _, last in results:
            if last is not None and last.spec is not None:
                drafts, accepted = drafts + last.spec.num_drafts, accepted + last.spec.num_accepted_tokens
    return outputs, seconds, drafts, accepted


async def collect(engine, request):
    tokens, last = [], None
    async for output in engine.generate(request):
        tokens += output.token_ids
        last = output
    return tokens, last


async def bench(args) -> int:
    loaded = load_model(args.model, device="cpu", dtype="float32")
    eos = sorted(loaded.eos_token_ids)

    def greedy(prompt, max_tokens):
        return transformers_baseline.generate_one(loaded.model, prompt, max_tokens, eos).tokens

    workloads = [w for w in build_workloads(loaded.tokenizer, 1, 64, args.max_tokens, greedy, args.turns)
                 if w.name in WORKLOADS]
    runner = create_runner(loaded.model, max(args.concurrency), 4096, owns_model=True)
    modes = {"none": None, f"chain K={args.k}": {"num_speculative_tokens": args.k},
             f"tree depth {args.k}, N={args.nodes}": {"num_speculative_tokens": args.k, "num_draft_tokens": args.nodes},
             f"chain K={args.nodes}": {"num_speculative_tokens": args.nodes},
             f"tree depth {args.nodes}, N={args.nodes}": {"num_speculative_tokens": args.nodes,
                                                          "num_draft_tokens": args.nodes}}
    print(json.dumps(describe_hardware()))
    drafter = (f"suffix decoding (min_token_prob {SuffixOptions().suffix_decoding_min_token_prob})"
               if args.method == "suffix" else "prompt lookup (ngram)")
    print(f"{args.model}, greedy, {drafter}, adaptive speculation off (every draft verified), {args.rounds} rounds, "
          "modes interleaved")
    ids, differ = RequestIds(), 0
    with ThreadPoolExecutor(1) as compute:
        async with build_engine(runner, eos, compute, adaptive_speculation=False) as engine:
            differ = await measure(engine, ids, workloads, modes, args)
    if differ:
        print(f"{differ} speculative runs differ from no speculation", file=sys.stderr)
    return 1 if differ else 0


async def measure(engine, ids: RequestIds, workloads, modes: dict, args) -> int:
    """Every workload at each concurrency, the modes interleaved; prints the tables, returns how many speculative
    runs differed from no speculation."""
    differ = 0
    for workload in workloads:
        for concurrency in args.concurrency:
            measured: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
            # an unmeasured pass: every mode then finds the prompts in the prefix cache
            reference, *_ = await run_mode(engine, ids, workload.prompts, workload.max_tokens, None, concurrency)
            for round_ in range(args.rounds):
                order = list(modes) if round_ % 2 == 0 else list(modes)[::-1]
                for name in order:
                    outputs, seconds, drafts, accepted = await run_mode(
                        engine, ids, workload.prompts, workload.max_tokens, modes[name], concurrency, args.method)
                    tokens = sum(len(t) for per_prompt in outputs for t in per_prompt)
                    measured[name].append((tokens / seconds, accepted / drafts if drafts else 0.0))
                    if outputs != reference:
                        differ += 1
                        print(f"OUTPUT DIFFERS: {workload.name}, {concurrency} at once, {name}", file=sys.stderr)
                    print(f"  {workload.name} x{concurrency} round {round_ + 1} {name}: {tokens / seconds:.1f}"
                          " tok/s", file=sys.stderr, flush=True)
            none = statistics.median(s for s, _ in measured["none"])
            print(f"\n{workload.name} ({len(workload.prompts)} prompts in order, {workload.max_tokens} tokens "
                  f"max), {concurrency} at once")
            print("| mode | tok/s | vs none | accepted per draft |")
            print("|---|---:|---:|---:|")
            for name in modes:
                speed = statistics.median(s for s, _ in measured[name])
                acceptance = statistics.median(a for _, a in measured[name])
                print(f"| {name} | {speed:.1f} | {speed / none:.2f}x | "
                      f"{'-' if name == 'none' else f'{acceptance:.2f}'} |")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--method", choices=["suffix", "ngram"], default="suffix", help="the drafter")
    parser.add_argument("--k", type=int, default=5, help="the chain's tokens, and the tree's depth budget")
    parser.add_argument("--nodes", type=int, default=12, help="the tree's tokens (num_draft_tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3)
    return asyncio.run(bench(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
