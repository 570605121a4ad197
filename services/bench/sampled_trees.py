"""`python -m services.bench.sampled_trees`: EAGLE token trees for sampled requests, side by side in one run: no
speculation, the deterministic EAGLE-2 tree (the coupled rule: its output equals speculation off's), and the tree
drawn from the head at the request's temperature and sent with q (`eagle_sampled_trees`: multi-draft rejection
sampling), one request at a time, seeded, on held-out ShareGPT chats.

Both drafters run as deployed, a `specserve drafter` process each reached over gRPC, so the q-tree row pays for its
dense q on the link. Adaptive speculation is off (every tree verified whole). Each round runs every system once;
tok/s and tokens a step are medians over rounds. The deterministic tree's outputs must equal speculation off's (exit
code 1 otherwise); the q-tree's follow the same distribution but not the same samples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
from collections.abc import Sequence

import torch

from services.bench import available_cores, stderr_progress
from services.bench.drafter_process import drafter_process
from services.bench.eagle_bench import held_out_prompts
from services.bench.hardware import describe_hardware
from services.bench.specserve_runs import generate_one
from services.modeling.eagle_heads import shipped_head
from services.modeling.loading import load_model
from services.modeling.runner_factory import create_runner
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig

SYSTEMS = (("off", None), ("tree, deterministic", "eagle-tree"), ("tree drawn with q", "eagle-qtree"))


async def one_round(runner, eos, addresses: dict[str, str], fingerprint: str, prompts, args) -> dict[str, list]:
    """Each system over every prompt: {system: [(tokens, seconds, steps) per prompt]}."""
    proposers = {method: RemoteProposer(RemoteProposerConfig(address, runner.vocab_size, fingerprint,
                                                             step_timeout_s=None), method=method)
                 for method, address in addresses.items()}
    engine = Engine(runner, EngineConfig(log_stats_interval_s=0, adaptive_speculation=False), proposers, eos)
    out: dict[str, list] = {}
    try:
        async with engine:
            for name, method in SYSTEMS:
                await generate_one(engine, f"warm-{name}", prompts[0], 8, method, args.nodes, args.temperature, 1)
                runs = []
                for i, prompt in enumerate(prompts):
                    g = await generate_one(engine, f"{name}-{i}", prompt, args.max_tokens, method, args.nodes,
                                           args.temperature, seed=1000 + i)
                    runs.append((g.tokens, g.seconds, g.num_steps))
                out[name] = runs
    finally:
        for proposer in proposers.values():
            await proposer.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.sampled_trees", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4, help="num_speculative_tokens: a path's most tokens")
    parser.add_argument("--nodes", type=int, default=8, help="num_draft_tokens: a tree's most tokens")
    parser.add_argument("--topk", type=int, default=2, help="eagle_topk")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    progress = stderr_progress()
    torch.set_num_threads(available_cores())
    target = load_model(args.model)
    prompts = held_out_prompts(target.tokenizer, args.num_prompts)
    runner = create_runner(target.model, 1, max(map(len, prompts)) + args.max_tokens + 64)
    eos = sorted(target.eos_token_ids)
    tree = {"method": "eagle", "model": str(shipped_head()), "num_speculative_tokens": args.depth,
            "num_draft_tokens": args.nodes, "eagle_topk": args.topk}
    rounds = []
    with contextlib.ExitStack() as stack:
        addresses = {
            "eagle-tree": stack.enter_context(drafter_process(["--speculative-config", json.dumps(tree)], progress))[0],
            "eagle-qtree": stack.enter_context(drafter_process(
                ["--speculative-config", json.dumps({**tree, "eagle_sampled_trees": True})], progress))[0]}
        for number in range(args.rounds):
            progress(f"round {number + 1}/{args.rounds}")
            rounds.append(asyncio.run(one_round(runner, eos, addresses, tokenizer_fingerprint(target.tokenizer),
                                                prompts, args)))
    print(f"{target.model_id}, shipped EAGLE head, trees depth {args.depth}, {args.nodes} tokens, top-{args.topk}; "
          f"{len(prompts)} held-out ShareGPT chats at temperature {args.temperature}, seeded, {args.max_tokens} "
          f"tokens, 1 request, adaptive off, drafters over gRPC; medians of {args.rounds} rounds; "
          f"{describe_hardware()}")
    rates = {name: statistics.median(sum(len(t) for t, _, _ in r[name]) / sum(s for _, s, _ in r[name])
                                     for r in rounds) for name, _ in SYSTEMS}
    per_step = {name: statistics.median(sum(len(t) for t, _, _ in r[name]) / max(1, sum(n for *_, n in r[name]))
                                        for r in rounds) for name, _ in SYSTEMS}
    print("| system | tok/s | tokens a step | vs off | vs the deterministic tree |\n|---|---:|---:|---:|---:|")
    for name, _ in SYSTEMS:
        print(f"| {name} | {rates[name]:.1f} | {per_step[name]:.2f} | {rates[name] / rates['off']:.2f}x | "
              f"{rates[name] / rates['tree, deterministic']:.2f}x |")
    differ = sum(a[0] != b[0] for r in rounds for a, b in zip(r["off"], r["tree, deterministic"], strict=True))
    if differ:
        print(f"{differ} deterministic-tree outputs differ from speculation off's: speculation changed the output")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
