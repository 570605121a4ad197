"""`python -m services.bench.eagle_tree_sweep`: tokens committed per step by the shipped EAGLE head as a chain and
as EAGLE-2 trees of several shapes, on held-out ShareGPT chats, greedy, every draft verified (adaptive off).

With `--temperature T` the requests sample (seeded); `--sampled-trees` adds, for each shape, the tree drawn from
the head at T and sent with q (eagle_sampled_trees: multi-draft rejection sampling), beside the deterministic one.

A count, not a timing: it is what a tree buys before its verify width is paid for, so it holds on any machine and
is how the tree rows of `make bench-eagle` were chosen (their tokens per second are measured there). The drafter
runs in-process here (the same proposer the drafter service runs); each shape's output must equal the chain's
(exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

import torch

from services.bench import available_cores
from services.bench.eagle_bench import held_out_prompts
from services.bench.hardware import describe_hardware
from services.bench.specserve_runs import generate_one
from services.common.drafter_methods import build_proposer
from services.common.speculative_config import SpeculativeConfig
from services.modeling.loading import load_model
from services.modeling.runner_factory import create_runner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig

DEFAULT_TREES = "4:10:4,4:16:4,4:16:8,4:24:8,4:32:8,5:24:8"  # depth:tokens:topk


def parse_trees(text: str) -> list[tuple[int, int, int]]:
    """"depth:tokens:topk,..." -> [(depth, tokens, topk), ...]."""
    shapes = []
    for part in text.split(","):
        depth, nodes, topk = (int(v) for v in part.split(":"))
        shapes.append((depth, nodes, topk))
    return shapes


async def tokens_per_step(engine: Engine, prompts, max_tokens: int, k: int, name: str,
                          temperature: float = 0.0) -> tuple[float, list]:
    tokens = steps = 0
    outputs = []
    async with engine:
        for i, prompt in enumerate(prompts):
            generation = await generate_one(engine, f"{name}-{i}", prompt, max_tokens, "eagle", k, temperature,
                                            seed=1000 + i if temperature else None)
            tokens, steps = tokens + len(generation.tokens), steps + generation.num_steps
            outputs.append(generation.tokens)
    return tokens / max(1, steps), outputs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.eagle_tree_sweep",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chain-k", type=int, default=4)
    parser.add_argument("--trees", default=DEFAULT_TREES, help="depth:tokens:topk shapes, comma-separated")
    parser.add_argument("--device", default="cpu", help="the target's and the head's (cuda: with --dtype bfloat16)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample (seeded) at this temperature")
    parser.add_argument("--sampled-trees", action="store_true",
                        help="also each shape drawn at the temperature and sent with q (eagle_sampled_trees)")
    args = parser.parse_args(argv)
    torch.set_num_threads(available_cores())
    target = load_model(args.model, device=args.device, dtype=args.dtype)
    prompts = held_out_prompts(target.tokenizer, args.num_prompts)
    shapes = parse_trees(args.trees)
    runner = create_runner(target.model, 1, max(map(len, prompts)) + args.max_tokens + 64)
    eos = sorted(target.eos_token_ids)
    sampling = f"temperature {args.temperature}" if args.temperature else "greedy"
    print(f"{target.model_id}, shipped EAGLE head, {len(prompts)} held-out ShareGPT chats, {sampling}, "
          f"{args.max_tokens} tokens, adaptive off; {describe_hardware()}")

    def measure(config: dict, k: int, name: str) -> tuple[float, list]:
        proposer = build_proposer(SpeculativeConfig.model_validate(
            {"method": "eagle", "draft_device": args.device, "draft_dtype": args.dtype, **config}))
        engine = Engine(runner, EngineConfig(log_stats_interval_s=0, adaptive_speculation=False), {"eagle": proposer},
                        eos)
        return asyncio.run(tokens_per_step(engine, prompts, args.max_tokens, k, name, args.temperature))

    chain, reference = measure({"num_speculative_tokens": args.chain_k}, args.chain_k, "chain")
    print(f"chain K={args.chain_k}: {chain:.3f} tokens a step")
    differ = 0
    for depth, nodes, topk in shapes:
        rate, outputs = measure({"num_speculative_tokens": depth, "num_draft_tokens": nodes, "eagle_topk": topk},
                                nodes, f"tree{depth}-{nodes}-{topk}")
        differ += sum(a != b for a, b in zip(outputs, reference, strict=True))
        print(f"tree depth {depth}, {nodes} tokens, top-{topk}: {rate:.3f} tokens a step "
              f"({rate / chain:.2f}x the chain)")
        if args.sampled_trees and args.temperature:  # its output follows the target's distribution, not the chain's
            rate, _ = measure({"num_speculative_tokens": depth, "num_draft_tokens": nodes, "eagle_topk": topk,
                               "eagle_sampled_trees": True}, nodes, f"qtree{depth}-{nodes}-{topk}")
            print(f"  drawn at T={args.temperature}, with q: {rate:.3f} tokens a step ({rate / chain:.2f}x the chain)")
    if differ:
        print(f"{differ} outputs differ from the chain's: speculation changed the output")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
