"""Where an engine step's time goes, function by function: the host side under cProfile, the device side as
torch.profiler's kernels of one eager forward.

Run: `python -m services.bench.step_host_profile --device cuda --dtype bfloat16 [--loads 1 8] [--top 25]`.
For each load, an in-process engine (captured steps where the device has graphs) answers that many greedy chats
without speculation and with ngram (K = 4) under cProfile, and the functions with the most time of their own
are printed: what the host does between two replays (building inputs, launching, waiting, drafting, committing).
Then, on CUDA, one eager decode forward at batch 1 under torch.profiler: the kernels by device time and count,
which are the kernels a captured step replays; one replayed step graph's device time by rows, width and span
(what a verify width and the span floor cost); and a layer's norm and attention, plain against fused. A
diagnostic for issue 29's step, not a benchmark: cProfile slows Python-heavy code more than C, so read the
ranking, not the milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
from collections.abc import Sequence

import torch

from services.bench.accelerator_step import NGRAM, generate_all
from services.bench.hardware import describe_hardware
from services.bench.prompts import chat_token_ids
from services.eagle.chat_prompts import chat_prompt_messages
from services.inprocess import LocalEngineOptions, build_local_engine
from services.modeling.attention import grouped_attention
from services.modeling.attention_choice import FORMS, choose_attention, probe_inputs
from services.modeling.device_timing import graph_time_us
from services.modeling.forward_batch import build_forward_batch
from services.modeling.fused_norm import fused_rms_norm, module_norm
from services.modeling.loading import LoadedModel, load_model
from services.modeling.registry import DEFAULT_MODEL
from services.modeling.runner import RowInput
from services.modeling.runner_factory import create_runner
from services.modeling.step_graphs import GraphSettings
from services.verifier import engine as engine_module
from services.verifier.sampling_params import SpeculationParams


def host_profile(loaded: LoadedModel, options: LocalEngineOptions, prompts: Sequence[Sequence[int]],
                 max_tokens: int, top: int) -> dict[str, str]:
    """cProfile's top functions (own time) over one run of `prompts`, without speculation and with ngram: the
    loop thread's and the compute thread's (where the step's tensor work runs) apart."""
    engine, _ = build_local_engine(options, loaded)
    speculation = SpeculationParams(NGRAM.method, NGRAM.num_speculative_tokens)
    reports = {}
    execute = engine_module.execute_isolating_faults
    compute = [cProfile.Profile()]

    def profiled_execute(*args):
        return compute[0].runcall(execute, *args)

    async def run():
        async with engine:
            await generate_all(engine, prompts, 8, SpeculationParams())  # warm-up
            for name, params in (("none", SpeculationParams()), ("ngram", speculation)):
                loop, compute[0] = cProfile.Profile(), cProfile.Profile()
                loop.enable()
                await generate_all(engine, prompts, max_tokens, params)
                loop.disable()
                reports[f"{name}, loop thread"] = top_functions(loop, top)
                if sys.version_info < (3, 12):
                    reports[f"{name}, compute thread"] = top_functions(compute[0], top)

    if sys.version_info < (3, 12):  # cProfile follows the thread that enabled it; from 3.12 every thread at once
        engine_module.execute_isolating_faults = profiled_execute
    try:
        asyncio.run(run())
    finally:
        engine_module.execute_isolating_faults = execute
    return reports


def top_functions(profiler: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip() and "Ordered by" not in line)


def kernel_profile(loaded: LoadedModel, prompt: Sequence[int], top: int) -> str:
    """torch.profiler's CUDA kernels of one eager decode forward at batch 1, by device time."""
    runner = create_runner(loaded.model, 1, 2048, graphs=GraphSettings(enforce_eager=True))
    runner.add_sequence("p")
    runner.forward([RowInput("p", list(prompt), 1)])
    for _ in range(3):
        runner.forward([RowInput("p", [prompt[0]], 1)])
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        runner.forward([RowInput("p", [prompt[0]], 1)])
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    total = sum(sum(times) for times in kernels.values())
    count = sum(len(times) for times in kernels.values())
    lines = [f"{count} kernels, {total / 1000:.2f} ms of device time in one eager decode forward at batch 1"]
    for name, times in sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]:
        lines.append(f"  {sum(times) / 1000:6.3f} ms  {len(times):5d} x  {name[:110]}")
    return "\n".join(lines)


@torch.inference_mode()  # as the runner's forward and capture run
def replay_costs(loaded: LoadedModel, rows: Sequence[int], widths: Sequence[int], spans: Sequence[int]) -> str:
    """Device ms of one replayed step graph by (rows, width, span), each captured from a batch of padding as the
    engine captures ahead: what a verify width and the span floor cost on this device (CUDA events around 20
    replays, inputs copied in each time as in serving)."""
    runner = create_runner(loaded.model, max(rows), max(spans))
    lines = [f"{'rows':>6} {'width':>6} " + " ".join(f"{f'span {span}':>11}" for span in spans)]
    for n in rows:
        for width in widths:
            cells = []
            for span in spans:
                batch = build_forward_batch(runner.cache, [], [], torch.device("cpu"), shape=(n, width, span))
                if runner.graphs.run(batch) is None:  # the capture failed (logged): nothing to time
                    cells.append("no graph")
                    continue
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    runner.graphs.run(batch)
                end.record()
                torch.cuda.synchronize()
                cells.append(f"{start.elapsed_time(end) / 20:8.3f} ms")
            lines.append(f"{n:>6} {width:>6} " + " ".join(f"{cell:>11}" for cell in cells))
    return "\n".join(lines)


def alternatives(loaded: LoadedModel) -> str:
    """Device time of a layer's pieces, the plain way against a fused one, at SmolLM2's shapes; the norm at 1 and 8
    rows of 1 and 5 tokens, with how many outputs differ bit for bit; attention in each form attention_choice.py
    measures, at 1, 8 and 64 rows of 1 and 5 tokens over 512 and 4,096 positions, with the kernel each form ran
    longest in (SDPA's choice); and the forms the runner's start-up measurement chose."""
    model = loaded.model
    layer, config = model.model.layers[0], model.config
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    hidden_size, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden_size // heads
    norm = layer.input_layernorm
    lines = []
    for rows, width in ((1, 1), (1, 5), (8, 5)):
        x = torch.randn(rows, width, hidden_size, device=device, dtype=dtype)
        same = (module_norm(norm, x) == fused_rms_norm(norm, x)).float().mean().item()
        lines.append(f"  rms norm [{rows},{width},{hidden_size}]: transformers "
                     f"{graph_time_us(lambda: module_norm(norm, x)):.1f} us, F.rms_norm "
                     f"{graph_time_us(lambda: fused_rms_norm(norm, x)):.1f} us; {100 * same:.2f}% of outputs identical")
    for span in (512, 4096):
        for rows, width in ((1, 1), (1, 5), (8, 1), (8, 5), (64, 1), (64, 5)):
            inputs = probe_inputs(rows, width, span, heads, kv_heads, head_dim, device, dtype)
            reference = grouped_attention(*inputs).float()
            cells = []
            for name, form in FORMS.items():
                difference = (form(*inputs).float() - reference).abs().max().item()
                cells.append(f"{name} {graph_time_us(lambda form=form: form(*inputs)):.1f} us "
                             f"[{longest_kernel(lambda form=form: form(*inputs))[:48]}; {difference:.1e}]")
            lines.append(f"  attention [{rows}x{width} over {span}]: " + ", ".join(cells))
    chosen = choose_attention(device, dtype, heads, kv_heads, head_dim)
    lines.append(f"  the runner's start-up choice: {getattr(chosen, 'description', chosen)}")
    return "\n".join(lines)


def longest_kernel(fn) -> str:
    """The name of the CUDA kernel one eager call of `fn` spends the most device time in (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us()
    return max(kernels, key=kernels.__getitem__) if kernels else "no kernel"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.step_host_profile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--only-device", action="store_true", help="skip the cProfile runs")
    args = parser.parse_args(argv)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    device = next(loaded.model.parameters()).device
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    chats = [chat_token_ids(loaded.tokenizer, m) for m in chat_prompt_messages()]
    options = LocalEngineOptions(model=args.model, device=args.device, dtype=args.dtype,
                                 max_num_seqs=max(args.loads), enable_prefix_caching=False, speculative_config=NGRAM)
    for load in [] if args.only_device else args.loads:
        prompts = [chats[i % len(chats)] for i in range(load)]
        for name, report in host_profile(loaded, options, prompts, args.max_tokens, args.top).items():
            print(f"\n=== {load} concurrent chats, {name}: cProfile, by own time ===\n{report}", flush=True)
    if device.type == "cuda":
        print("\n=== " + kernel_profile(loaded, chats[0], args.top), flush=True)
        print("\n=== one replayed step graph by rows, width and span (device time)\n"
              + replay_costs(loaded, (1, 8, 64), (1, 2, 3, 5, 9), (256, 512, 1024, 2048, 4096)), flush=True)
        print("\n=== a layer's pieces, plain and fused (device time from graphs)\n" + alternatives(loaded),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
