"""Structured output under speculation, measured: what the grammar mask costs per verify step, and JSON-schema
requests with ngram speculation against the same requests without it (tok/s, acceptance), greedy, in one run.

    python -m services.bench.grammar_cost [--model smollm2-135m-instruct] [--repeats 3]

The mask cost is llguidance walking each grammar row's K drafts (and rolling back) plus the masking, timed on
real drafts (JSON text the model wrote); the request timings run the in-process engine (no HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from services.bench.hardware import describe_hardware
from services.common.speculative_config import SpeculativeConfig
from services.gateway.tokenizer import encode_chat
from services.inprocess import LocalEngineOptions, build_local_engine
from services.verifier.sampling_params import (
    GenerationRequest,
    OutputGrammar,
    SamplingParams,
    SpeculationParams,
)
from services.verifier.structured_output import build_constraint, constrain_logits

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
PROMPTS = ["Describe a fictional person as JSON with name, age and hobbies.",
           "Return JSON for Ada Lovelace: name, age at death, hobbies.",
           "Give me a JSON record of a chess player (name, age, hobbies).",
           "A JSON profile of a retired sailor with name, age and hobbies, please."]
K = 4


async def run_requests(engine, tokenizer, grammar: OutputGrammar | None, spec: SpeculationParams) -> dict:
    tokens = drafted = accepted = 0
    started = time.perf_counter()
    texts = []
    for i, prompt in enumerate(PROMPTS):  # one at a time: the latency a single user sees
        ids = tuple(encode_chat(tokenizer, [{"role": "user", "content": prompt}]))
        params = SamplingParams(max_tokens=160, temperature=0.0, structured_output=grammar)
        out, last = [], None
        async for last in engine.generate(GenerationRequest(f"g{time.perf_counter_ns()}-{i}", ids, params, spec)):
            out += last.token_ids
        tokens += len(out)
        drafted += last.spec.num_draft_tokens
        accepted += last.spec.num_accepted_tokens
        texts.append(tokenizer.decode(out))
    seconds = time.perf_counter() - started
    return {"tok_s": tokens / seconds, "draft_tokens": drafted, "accepted": accepted, "texts": texts}


def forced_share(engine, tokenizer, texts: list[str]) -> float:
    """Share of the output tokens the grammar forces (its mask allows one token): what jump-forward decoding,
    which appends such tokens without asking the model, could save at most."""
    forced = total = 0
    for text in texts:
        constraint = build_constraint(SamplingParams(structured_output=OutputGrammar("json_schema", json.dumps(PERSON))),
                                      engine.grammars, engine.runner.vocab_size)
        for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
            logits = torch.zeros(1, 1, engine.runner.vocab_size)
            constrain_logits(logits, [constraint], [[]])
            forced += int(torch.isfinite(logits).sum() == 1)
            total += 1
            constraint.matcher.consume_token(token)
    return forced / max(1, total)


def mask_cost_ms(engine, tokenizer, rows: int, text: str, repeats: int = 200) -> float:
    """Median ms to mask a [rows, K+1, V] step whose rows each verify K real draft tokens of `text`."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    vocab = engine.runner.vocab_size
    constraints = [build_constraint(SamplingParams(structured_output=OutputGrammar("json_schema", json.dumps(PERSON))),
                                    engine.grammars, vocab) for _ in range(rows)]
    times = []
    for start in range(0, max(1, len(ids) - K), max(1, (len(ids) - K) // repeats)):
        for c in constraints:  # every row at the same real prefix, drafting the next K tokens of the text
            c.matcher.reset()
            c.matcher.consume_tokens(ids[:start])
        logits = torch.zeros(rows, K + 1, vocab)
        began = time.perf_counter()
        constrain_logits(logits, constraints, [ids[start : start + K]] * rows)
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


async def main_async(args: argparse.Namespace) -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=K)
    engine, loaded = build_local_engine(LocalEngineOptions(model=args.model, speculative_config=config))
    tokenizer = loaded.tokenizer
    print("hardware:", describe_hardware())
    grammar = OutputGrammar("json_schema", json.dumps(PERSON))
    results: dict[str, list[dict]] = {}
    async with engine:
        for _ in range(args.repeats):
            for name, g, spec in (("schema, no speculation", grammar, SpeculationParams()),
                                  (f"schema, ngram K={K}", grammar, SpeculationParams("ngram", K)),
                                  ("free, no speculation", None, SpeculationParams()),
                                  (f"free, ngram K={K}", None, SpeculationParams("ngram", K))):
                results.setdefault(name, []).append(await run_requests(engine, tokenizer, g, spec))
        sample = results["schema, no speculation"][0]["texts"][0]
        costs = {rows: mask_cost_ms(engine, tokenizer, rows, sample) for rows in (1, 4)}
        forced = forced_share(engine, tokenizer, results["schema, no speculation"][0]["texts"])
    print(f"\n{len(PROMPTS)} prompts, greedy, up to 160 tokens, {args.repeats} rounds (medians):")
    print(f"{'run':<24} {'tok/s':>7} {'acceptance':>11}")
    for name, runs in results.items():
        drafted = sum(r["draft_tokens"] for r in runs)
        rate = sum(r["accepted"] for r in runs) / drafted if drafted else float("nan")
        print(f"{name:<24} {statistics.median(r['tok_s'] for r in runs):>7.1f} {rate:>11.2f}")
    same = all(a["texts"] == b["texts"] for a, b in zip(results["schema, no speculation"],
                                                         results[f"schema, ngram K={K}"], strict=True))
    speedup = (statistics.median(r["tok_s"] for r in results[f"schema, ngram K={K}"])
               / statistics.median(r["tok_s"] for r in results["schema, no speculation"]))
    print(f"\nschema: ngram / no speculation = {speedup:.2f}x; outputs identical: {same}")
    print(f"mask cost per verify step (K={K}, real JSON drafts): 1 row {costs[1]:.2f} ms, 4 rows {costs[4]:.2f} ms")
    print(f"output tokens the grammar forces (jump-forward's bound): {forced:.0%}")
    if not same:
        raise SystemExit("speculative structured output differs from the output without speculation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
