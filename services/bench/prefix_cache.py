"""What the paged KV cache and prefix caching buy, measured side by side in one run on the in-process engine.

- A 4-turn chat, each turn quoting the conversation so far: time to first token of turns 2-4 with prefix caching
  on and off (greedy; the answers must be identical). Twice: a first message of FIRST_TURN_TOKENS, then
  follow-ups of FOLLOW_UPS tokens each. Only the follow-up and the previous answer are new in a turn, so the ratio
  is bounded by the prompt's length over theirs: with 300-token follow-ups (and 16-token answers) turn 3 prefills
  a third of its prompt anyway (948 tokens, 316 new), whatever the cache does; 40-token follow-ups are a chat's.
- A shared system prompt of about SYSTEM_TOKENS tokens across REQUESTS requests, sent one after another: mean
  time to first token with caching on and off.
- The shared system prompt again with EAGLE speculation (the shipped head, where the model has one): its
  requests read the target's hidden states, which the cache keeps beside K/V, so they reuse the prefix too.
- A long prompt (LONG_TOKENS) with the default flags: answered, with its time to first token.
- MIXED_LONG prompts of that length and MIXED_SHORT short chats sent at once: every one answered, no error, the
  KV pool's peak use, and how long the short chats waited for their first token beside the long prefills.
- In a process of its own (kv_step_speed.py): decode-step time of the two KV read paths at 1, 8 and 16 rows and
  short and long contexts, and the verifier's resident memory against its weights and pool.
Prints the hardware, the KV pool and the ratios; exits 1 if an answer differs between caching on and off or a
request of the mixed load fails.

    python -m services.bench.prefix_cache [--model smollm2-135m-instruct] [--long-tokens 6000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from services.bench.hardware import describe_hardware
from services.inprocess import LocalEngineOptions, build_local_engine
from services.modeling.loading import load_model
from services.common.speculative_config import SpeculativeConfig
from services.modeling.eagle_heads import shipped_heads
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams

SYSTEM_TOKENS = 1000
REQUESTS = 16
EAGLE_REQUESTS = 6
LONG_TOKENS = 6000
TURNS = 4
FIRST_TURN_TOKENS = 300
FOLLOW_UPS = (300, 40)  # tokens of each later user message, one conversation per size
ANSWER_TOKENS = 16
MIXED_LONG = 8
MIXED_SHORT = 32
SHORT_TOKENS = 40


def filler(tokenizer, tokens: int, seed: int) -> list[int]:
    """About `tokens` tokens of varied English, so that nothing is cached by accident. Words are added in batches
    of about half the tokens still missing (a word is 2-4 tokens), so a long filler is encoded a few times, not
    once every 50 words."""
    words = "the river carried stone and light past towns whose names the maps forgot while traders argued".split()
    text, ids = [], []
    index = seed
    while len(ids) < tokens:
        for _ in range(max(50, (tokens - len(ids)) // 2)):
            text.append(words[index % len(words)] + str(index % 97))
            index = index * 7 + 3
        ids = tokenizer.encode(" ".join(text))
    return ids[:tokens]


async def first_token(engine, request_id: str, prompt: list[int], max_tokens: int,
                      speculation: SpeculationParams = SpeculationParams()) -> tuple[float, list[int], int]:
    """(seconds to the first token, the tokens, cached prompt tokens)."""
    started = time.perf_counter()
    ttft, tokens, cached = None, [], 0
    request = GenerationRequest(request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                speculation)
    async for output in engine.generate(request):
        if ttft is None and output.token_ids:
            ttft = time.perf_counter() - started
        tokens.extend(output.token_ids)
        cached = output.num_cached_tokens
    return ttft, tokens, cached


async def run(options: LocalEngineOptions, loaded, long_tokens: int) -> dict:
    tokenizer = loaded.tokenizer
    engine, _ = build_local_engine(options, loaded)
    await engine.start()
    try:
        turns = {}
        for follow_up in FOLLOW_UPS:
            chat, turns[follow_up] = [], []
            for turn in range(TURNS):
                size = FIRST_TURN_TOKENS if turn == 0 else follow_up
                chat += filler(tokenizer, size, seed=1000 * follow_up + turn + 1)
                ttft, answer, cached = await first_token(engine, f"turn{follow_up}-{turn}", chat, ANSWER_TOKENS)
                turns[follow_up].append({"ttft_s": ttft, "cached": cached, "answer": answer, "prompt": len(chat)})
                chat += answer
        system = filler(tokenizer, SYSTEM_TOKENS, seed=99)
        shared = []
        for index in range(REQUESTS):
            ttft, answer, cached = await first_token(engine, f"shared{index}", system + filler(tokenizer, 20, index),
                                                     ANSWER_TOKENS)
            shared.append({"ttft_s": ttft, "cached": cached, "answer": answer})
        long, mixed = None, None
        if long_tokens:
            ttft, answer, cached = await first_token(engine, "long", filler(tokenizer, long_tokens, seed=7), 8)
            long = {"ttft_s": ttft, "tokens": long_tokens, "answer": answer}
            mixed = await mixed_load(engine, tokenizer, long_tokens)
        usage = engine.runner.kv_usage
        return {"turns": turns, "shared": shared, "long": long, "mixed": mixed,
                "pool_tokens": usage.total_blocks * usage.block_size, "block_size": usage.block_size}
    finally:
        await engine.shutdown()


async def eagle_shared(options: LocalEngineOptions, loaded) -> list[dict]:
    """The shared system prompt again, with EAGLE speculation (the shipped head): its requests read the target's
    hidden states, which the cache now keeps beside K/V, and the head caches its own prefix."""
    engine, _ = build_local_engine(options, loaded)
    await engine.start()
    try:
        system, out = filler(loaded.tokenizer, SYSTEM_TOKENS, seed=99), []
        for index in range(EAGLE_REQUESTS):
            prompt = system + filler(loaded.tokenizer, 20, index)
            ttft, answer, cached = await first_token(engine, f"eagle{index}", prompt, ANSWER_TOKENS,
                                                     SpeculationParams("eagle", 3))
            out.append({"ttft_s": ttft, "cached": cached, "answer": answer})
        return out
    finally:
        await engine.shutdown()


async def mixed_load(engine, tokenizer, long_tokens: int) -> dict:
    """MIXED_LONG long prompts and MIXED_SHORT short chats sent together; the pool's peak use sampled meanwhile."""
    prompts = ([(f"mixed-long{i}", filler(tokenizer, long_tokens, seed=1000 + i), 8) for i in range(MIXED_LONG)]
               + [(f"mixed-short{i}", filler(tokenizer, SHORT_TOKENS, seed=2000 + i), ANSWER_TOKENS)
                  for i in range(MIXED_SHORT)])
    peak_blocks = 0

    async def watch() -> None:
        nonlocal peak_blocks
        while True:
            peak_blocks = max(peak_blocks, engine.runner.kv_usage.used_blocks)
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(first_token(engine, rid, prompt, n) for rid, prompt, n in prompts),
                                       return_exceptions=True)
    finally:
        watcher.cancel()
    seconds = time.perf_counter() - started
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    done = [(rid, r) for (rid, _, _), r in zip(prompts, results) if not isinstance(r, BaseException) and r[1]]
    short_ttft = [r[0] for rid, r in done if rid.startswith("mixed-short")]
    long_ttft = [r[0] for rid, r in done if rid.startswith("mixed-long")]
    return {"seconds": seconds, "errors": errors, "answered": len(done), "sent": len(prompts),
            "short_ttft_s": short_ttft, "long_ttft_s": long_ttft, "peak_blocks": peak_blocks}


def spread(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds):.1f} s, max {max(seconds):.1f} s" if seconds else "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--long-tokens", type=int, default=LONG_TOKENS)
    args = parser.parse_args(argv)
    print(json.dumps(describe_hardware()))
    loaded = load_model(args.model, device="cpu", dtype="float32")
    results = {}
    for caching in (False, True):
        options = LocalEngineOptions(model=args.model, enable_prefix_caching=caching)
        results[caching] = asyncio.run(run(options, loaded, args.long_tokens if caching else 0))
    on, off = results[True], results[False]
    eagle = {}
    if args.model in shipped_heads():
        spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
        for caching in (False, True):
            options = LocalEngineOptions(model=args.model, enable_prefix_caching=caching, speculative_config=spec)
            eagle[caching] = asyncio.run(eagle_shared(options, loaded))
    shared_on = statistics.mean(r["ttft_s"] for r in on["shared"][1:])
    shared_off = statistics.mean(r["ttft_s"] for r in off["shared"][1:])
    print(f"KV pool: {on['pool_tokens']} tokens")
    for follow_up in FOLLOW_UPS:
        later_on = statistics.median(t["ttft_s"] for t in on["turns"][follow_up][1:])
        later_off = statistics.median(t["ttft_s"] for t in off["turns"][follow_up][1:])
        sizes = [(t["prompt"], t["cached"]) for t in on["turns"][follow_up]]
        print(f"chat turns 2-{TURNS} ({follow_up}-token follow-ups): median TTFT {later_off * 1e3:.0f} ms without "
              f"prefix caching, {later_on * 1e3:.0f} ms with ({later_off / later_on:.1f}x); (prompt, cached) tokens "
              f"per turn {sizes}")
    print(f"shared {SYSTEM_TOKENS}-token system prompt, requests 2-{REQUESTS}: mean TTFT {shared_off * 1e3:.0f} ms "
          f"without, {shared_on * 1e3:.0f} ms with ({shared_off / shared_on:.1f}x)")
    if eagle:
        eagle_on = statistics.mean(r["ttft_s"] for r in eagle[True][1:])
        eagle_off = statistics.mean(r["ttft_s"] for r in eagle[False][1:])
        print(f"the same with EAGLE speculation, requests 2-{EAGLE_REQUESTS}: mean TTFT {eagle_off * 1e3:.0f} ms "
              f"without, {eagle_on * 1e3:.0f} ms with ({eagle_off / eagle_on:.1f}x); cached tokens "
              f"{[r['cached'] for r in eagle[True]]}")
    if on["long"]:
        print(f"a {on['long']['tokens']}-token prompt: answered, first token after {on['long']['ttft_s']:.1f} s")
    mixed_ok = True
    if on["mixed"]:
        m = on["mixed"]
        mixed_ok = not m["errors"] and m["answered"] == m["sent"]
        peak_tokens = m["peak_blocks"] * on["block_size"]
        print(f"{MIXED_LONG} prompts of {args.long_tokens} tokens and {MIXED_SHORT} short chats at once: "
              f"{m['answered']}/{m['sent']} answered in {m['seconds']:.0f} s, errors {m['errors'] or 'none'}; KV pool "
              f"peak {peak_tokens} of {on['pool_tokens']} tokens; first token of the short chats "
              f"{spread(m['short_ttft_s'])}, of the long prompts {spread(m['long_ttft_s'])}")
    pairs = [*zip(on["shared"], off["shared"]), *zip(eagle.get(True, []), eagle.get(False, []))]
    pairs += [pair for follow_up in FOLLOW_UPS for pair in zip(on["turns"][follow_up], off["turns"][follow_up])]
    same = all(a["answer"] == b["answer"] for a, b in pairs)
    print("answers identical with and without prefix caching:", same)
    sys.stdout.flush()
    steps = subprocess.run([sys.executable, "-m", "services.bench.kv_step_speed", "--model", args.model])
    return 0 if same and mixed_ok and steps.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
