"""The accelerator step, captured vs eager, side by side in one run (issue 29's figures).

Run: `python -m services.bench.accelerator_step --device cuda --dtype bfloat16` (a few minutes on one GPU; it runs on
CPU too, where both modes are the same eager path). One model is loaded once; for each mode (eager: --enforce-eager,
captured: step graphs, invariant: captured and --batch-invariant) an in-process engine measures
- the decode step at batch 1: ms per step (step_profile's timers), and, on CUDA, kernel launches, stream syncs and
  host-to-device copies per step from torch.profiler (a request of 64 tokens less one of 32, so no prefill);
- tokens/s at 1, 8 and 64 concurrent greedy chat requests (sent all at once, one closed batch; `--rounds R`: each
  client sends R in turn, a steady load; each asks for its own number of tokens up to --max-tokens, since equal
  lengths keep a batch without speculation in lockstep, which favours it: request_lengths.py, `--lengths equal` as
  before stop 75), without speculation and with the default drafter
  (`--method`: what `specserve serve` drafts with here, suffix where arctic-inference is installed, each
  request's own tree only, else ngram; K = 4), and the code edit at 1 request (the answer is nearly the prompt:
  its drafts land), once more at K = 8;
  captured, also with each shipped EAGLE head (EAGLE-1 and EAGLE-3, K = 4; EAGLE-3's trees of 24 tokens, top-8,
  depth 4) on the same device; with each run's steps split into phases, and how many steps and rows asked for
  drafts and how many rows had one;
- whether each speculative greedy output equals the non-speculative one token for token;
and first, on an accelerator, whether captured and eager forwards give the same greedy outputs in float32.
Then transformers' own `generate` at batch 1 as the peer row. Medians and ratios, measured in this one run; exit 1
if, batch-invariant, a speculative greedy output differs from the non-speculative one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from services.bench.hardware import describe_hardware
from services.bench.request_lengths import add_lengths_argument, request_tokens
from services.bench.prompts import chat_token_ids, code_edit_message
from services.bench.step_profile import PROMPT, Timers, profile_runner
from services.common.drafter_methods import SERVE_PREFERENCE, first_runnable
from services.common.speculative_config import SpeculativeConfig
from services.eagle.chat_prompts import chat_prompt_messages
from services.inprocess import LocalEngineOptions, build_local_engine
from services.modeling.loading import LoadedModel, load_model
from services.modeling.registry import DEFAULT_MODEL
from services.modeling.runner_factory import create_runner
from services.modeling.step_graphs import GraphSettings
from services.verifier import draft_collection as collection_module
from services.verifier import engine as engine_module
from services.verifier.runner_kept_states import RunnerKeptStates
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from services.verifier.spec_stats import SpecDecodeStats

MODES = ("eager", "captured", "invariant")  # invariant: captured and batch-invariant (--batch-invariant)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def speculation_config(method: str) -> SpeculativeConfig:
    """The speculation rows' drafter, K = 4; the suffix drafter without its tree of earlier responses. This bench's
    prompts repeat (the warm-up sends each load's first round first, 64 chats send the 48 prompts four times, the
    edit runs twice), and that tree recalls their answers: on an H200 (stop 65) it accepted 2.5 of 3.1 tokens a
    draft at 64 chats (1.49x none) and 7.4 of 7.9 on an edit it had answered before (5.80x at K = 8), which says
    what a server answering the same requests again gets, not what chats get. `make bench` measures the whole
    suffix drafter on prompts that do not repeat (a fresh drafter per measurement)."""
    if method == "suffix":
        return SpeculativeConfig(method=method, num_speculative_tokens=4, suffix_decoding_max_cached_requests=0)
    return NGRAM.model_copy(update={"method": method})
# The code edit once more with the drafter asking for 8 tokens a step: on a captured step a width of 9 costs what 5 does
# (step_host_profile), and on the edit 8 tokens a step commit 4.1 tokens a step against K = 4's 3.1 (greedy, CPU)
LONG_K, EDIT_LONG = 8, "edit, K = 8"
# EAGLE rows: each shipped head's chains, and its EAGLE-2 trees of this shape (the tree rows of make bench-eagle)
EAGLE_ROWS = ("eagle", "eagle3", "eagle-tree", "eagle3-tree")
TREE_NODES, TREE_TOPK = 24, 8
PROFILED_COUNTS = {"launches": ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"),
                   "syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
                   "copies": ("cudaMemcpyAsync", "cudaMemcpy")}


def mode_runner(loaded: LoadedModel, mode: str):
    return create_runner(loaded.model, 1, 2048, graphs=GraphSettings(enforce_eager=mode == "eager"),
                         batch_invariant=mode == "invariant")


def step_counts(loaded: LoadedModel, mode: str, prompt: Sequence[int], tokens: int) -> dict[str, float]:
    """Launches, syncs and copies per decode step of one request, and ms of GPU kernels: torch.profiler over a
    request of `tokens` tokens and over one of 2 x `tokens`, the difference divided by `tokens`, so that what every
    request does once (its prefill, its first steps, taking its slot) counts in neither."""
    runner = mode_runner(loaded, mode)

    async def profiled(length: int) -> dict[str, float]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            await profile_runner(runner, prompt, length, 1)
        events = {e.key: e.count for e in profiler.key_averages()}
        counts = {name: float(sum(events.get(key, 0) for key in keys)) for name, keys in PROFILED_COUNTS.items()}
        kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts["ms of GPU kernels"] = sum(e.time_range.elapsed_us() for e in kernels) / 1000
        return counts

    async def run() -> dict[str, float]:
        await profile_runner(runner, prompt, 2 * tokens, 1)  # captures what it needs first
        short, long = await profiled(tokens), await profiled(2 * tokens)
        return {name: (long[name] - short[name]) / tokens for name in short}

    return asyncio.run(run())


async def generate_all(engine, prompts: Sequence[Sequence[int]], max_tokens: int,
                       speculation: SpeculationParams, clients: int | None = None, varied: bool = False
                       ) -> tuple[float, list[tuple[int, ...]]]:
    """All prompts, `clients` at a time, each client sending its next as its last ends (None: all at once); (tokens/s,
    each output's tokens, in the prompts' order). `varied`: prompt i asks for request_tokens(i, max_tokens) tokens
    (request_lengths.py), each its own; else each for `max_tokens`."""
    async def one(i: int) -> None:
        sampling = SamplingParams(max_tokens=request_tokens(i, max_tokens, varied), temperature=0.0)
        request = GenerationRequest(f"r{i}", tuple(prompts[i]), sampling, speculation)
        out: list[int] = []
        async for output in engine.generate(request):
            out += output.token_ids
        outputs[i] = tuple(out)

    async def client() -> None:
        for i in waiting:  # one iterator shared by the clients: each prompt is sent once
            await one(i)

    outputs: list[tuple[int, ...]] = [()] * len(prompts)
    waiting = iter(range(len(prompts)))
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(clients or len(prompts), len(prompts)))))
    return sum(map(len, outputs)) / (time.perf_counter() - started), outputs


class StepPhases:
    """Where an engine's steps spend their time, timed around the engine's own calls: drafting (the proposers'
    collection, and how many steps and rows asked and how many rows had a draft), the step's tensor work on the
    compute thread (forward, verification, the transfer that waits for the device), the forward's host part
    (launching or replaying, with the verification where a graph runs it) and, on CUDA, its device time from
    events, and the loop's own work (planning, committing, emitting), split into the first plan, the second plan,
    the commit of the rows and the cost model's update, the rest (admission, caps, KV reservation, the planner's
    other bookkeeping, the loop's turns) as one. Why: on an H200 at 64 chats the loop took 1.50 ms a step with
    ngram against 0.98 without (stop 74), more than this machine's simulation of that step shows, and which part
    grows there is what to cut next. Events are read after the run, so timing adds no sync. Drafting calls that
    ask a request for the first time are also timed apart ("openings": the drafter takes in the whole prompt, for
    EAGLE the head's prefill), so that an ask's cost after many steps unasked shows apart from a request's first;
    within the asks, the verifier's own reads of the asked rows' kept target states from the runner (catch_up) are
    timed apart with the positions they read, since an opening's cost is that read (the whole history of a row)
    plus the drafter's part, and the planner learns the two only as one figure (draft_cost.observe_opening). And
    the forward's host part is split three ways, as medians:
    before the run's first ask, after it in steps that asked, and after it in steps that did not. Why: on an H200
    the EAGLE-3 rows of the code edit (stop 65) spent 1.3-2.2 ms more a forward on the host than without
    speculation with only 5-14 asks in the run, and whether that comes with the asks or stays after the first
    one says where to look.

    And the planner's audit of the decode-only steps (plan_audit.py): by whether they asked for drafts, asked probes
    only, or asked nothing, the tokens and time each kind came to against what the plan predicted. Why: on an H200
    at 64 chats (stop 74) ngram asked at 104 of 370 steps, which cost 62% more than a plain step for 28% more tokens,
    where the CPU's simulated device has the planner ask rarely; this says whether a run's asking paid, and whether
    a loss came from tokens expected or from time unforeseen."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = {}
        self.steps = self.forwards = self.verified_in_graph = 0
        self.calls = self.rows_asked = self.rows_drafted = 0  # steps that asked, rows asked, rows answered a draft
        self.openings = 0  # drafting calls that asked some request for the first time
        self.step_asked = False  # the step under way asked for drafts
        self.host_by_phase: dict[str, list[float]] = {}  # forward host seconds: "before asks", "asked", "unasked"
        self._asked: set[str] = set()  # requests asked so far
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cuda = engine.runner.device.type == "cuda"
        step, collect, forward = engine.step, engine.drafts.collect, engine.runner.forward
        execute = engine_module.execute_isolating_faults
        self.audit = engine.planner.audit  # the planner's predictions of its steps against what they came to

        async def timed_step():
            self.steps += 1
            self.step_asked = False
            with self.timing("step"):
                await step()

        async def timed_collect(decode, lengths):
            first = {s.request_id for s, k in zip(decode, lengths, strict=True) if k > 0} - self._asked
            self._asked |= first
            self.openings += bool(first)
            with self.timing("drafting"), self.timing("openings" if first else "later asks"):
                drafts = await collect(decode, lengths)
            asked = sum(k > 0 for k in lengths)
            self.calls += asked > 0
            self.step_asked = asked > 0
            self.rows_asked += asked
            self.rows_drafted += sum(bool(draft.tokens) for draft in drafts)
            return drafts

        def timed_execute(*args):
            with self.timing("tensor work"):
                return execute(*args)

        def timed(run_forward):
            def timed_forward(*args):
                self.forwards += 1
                start = end = None
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                started = time.perf_counter()
                with self.timing("forward host"):
                    output = run_forward(*args)
                if output is not None:  # (a forward_with_tail that declined: the step's forward() follows)
                    phase = "asked" if self.step_asked else "unasked" if self.calls else "before asks"
                    self.host_by_phase.setdefault(phase, []).append(time.perf_counter() - started)
                if self.cuda:
                    end.record()
                    self.events.append((start, end))
                return output
            return timed_forward

        engine.step, engine.drafts.collect, engine.runner.forward = timed_step, timed_collect, timed(forward)
        # the loop's own parts (what a step spends outside drafting and the tensor work): the plans, the commit of
        # each row (timed a row at a time, which adds about half a microsecond a row) and the cost model's update
        for owner, name, phase in ((engine.planner, "draft_requests", "plan"),
                                   (engine.planner, "choose_drafts", "second plan"),
                                   (engine, "_commit", "commit"),
                                   (engine.planner, "observe_forward", "cost model")):
            setattr(owner, name, Timers(self.seconds).wrap(phase, getattr(owner, name)))
        if hasattr(engine.runner, "forward_with_tail"):  # a decode step with its verification in the graph
            with_tail = timed(engine.runner.forward_with_tail)

            def counted_with_tail(*args):
                output = with_tail(*args)
                self.verified_in_graph += output is not None
                self.forwards -= output is None  # the step then runs forward() too, which counts it
                return output

            engine.runner.forward_with_tail = counted_with_tail
        self._execute, self._timed_execute = execute, timed_execute
        # the verifier's own part of an ask: reading the asked rows' kept states from the runner (catch_up), timed
        # apart with the positions it read, so that an opening's cost splits into the verifier's read and the call
        self.catch_up_positions = 0
        catch_up = self._catch_up = collection_module.catch_up

        def timed_catch_up(kept):
            kept = list(kept)
            unread = [states.unread() for states in kept if isinstance(states, RunnerKeptStates)]
            self.catch_up_positions += sum(stop - start for _, start, stop in filter(None, unread))
            with self.timing("catch-up"):
                catch_up(kept)

        self._timed_catch_up = timed_catch_up

    def __enter__(self) -> StepPhases:
        engine_module.execute_isolating_faults = self._timed_execute  # the engine looks it up at each step
        collection_module.catch_up = self._timed_catch_up  # as the collector does
        return self

    def __exit__(self, *exc) -> None:
        engine_module.execute_isolating_faults = self._execute
        collection_module.catch_up = self._catch_up

    @contextlib.contextmanager
    def timing(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def reset(self) -> None:
        self.seconds.clear()
        self.events.clear()
        self.steps = self.forwards = self.verified_in_graph = 0
        self.calls = self.rows_asked = self.rows_drafted = self.openings = self.catch_up_positions = 0
        self._asked.clear()
        self.host_by_phase.clear()
        self.audit.reset()

    def summary(self) -> str:
        """ms per step of each phase, over the steps since reset()."""
        if self.cuda:
            torch.cuda.synchronize()
            self.seconds["forward on device"] = sum(s.elapsed_time(e) for s, e in self.events) / 1000
        per_step = {name: 1000 * value / max(self.steps, 1) for name, value in self.seconds.items()}
        loop = per_step.get("step", 0.0) - per_step.get("drafting", 0.0) - per_step.get("tensor work", 0.0)
        parts = ", ".join(f"{name} {per_step[name]:.2f}" for name in
                          ("drafting", "tensor work", "forward host", "forward on device") if name in per_step)
        asks = ""
        if self.calls:
            later = self.calls - self.openings
            asks = (f"; {self.calls} steps asked drafts of {self.rows_asked} rows, {self.rows_drafted} had one; "
                    f"ms an ask: {self.openings} openings "
                    f"{1000 * self.seconds.get('openings', 0.0) / max(self.openings, 1):.2f}, {later} later "
                    f"{1000 * self.seconds.get('later asks', 0.0) / max(later, 1):.2f} (the verifier's reads of kept "
                    f"states within them: {1000 * self.seconds.get('catch-up', 0.0):.1f} ms in all, "
                    f"{self.catch_up_positions} positions); ms of forward host "
                    "(medians): " + ", ".join(f"{phase} {1000 * statistics.median(seconds):.2f}"
                                              for phase, seconds in self.host_by_phase.items()))
            asks += f"; decode-only steps against the plan (plan_audit.py): {self.audit.describe()}"
        loop_parts = ("plan", "second plan", "commit", "cost model")
        known = sum(per_step.get(name, 0.0) for name in loop_parts)
        inside = ", ".join(f"{name} {per_step.get(name, 0.0):.2f}" for name in loop_parts)
        return (f"{self.steps} steps, {self.forwards} forwards ({self.verified_in_graph} verified in their graph); "
                f"ms a step: {per_step.get('step', 0.0):.2f} = {parts}, loop {loop:.2f} ({inside}, rest "
                f"{loop - known:.2f}){asks}")


def throughput(loaded: LoadedModel, options: LocalEngineOptions, prompts_by_load: dict[str, list],
               max_tokens: int, k_by_load: dict[str, int] | None = None, clients: dict[str, int] | None = None,
               varied: bool = False) -> dict[str, tuple[float, float, int, int, str]]:
    """Per load: (tok/s none, tok/s with options' speculative method, outputs identical, outputs, what the steps
    did: forwards and ms per forward of each run; with speculation, the drafts verified and accepted). A load in
    `k_by_load` asks for that many draft tokens a step instead of the options' K (a request may ask for any); a load in
    `clients` sends its prompts that many at a time (generate_all; otherwise all at once); `varied`: each request
    asks for its own number of tokens up to `max_tokens` (generate_all)."""
    method = options.speculative_config.method
    k_by_load = k_by_load or {}
    default_k = options.speculative_config.num_speculative_tokens
    speculation_by_load = {load: SpeculationParams(method, k_by_load.get(load, default_k)) for load in prompts_by_load}
    engine, _ = build_local_engine(options, loaded)
    phases = StepPhases(engine)
    clients = clients or {}

    async def timed_run(load, speculation_params):
        phases.reset()
        rate, outputs = await generate_all(engine, prompts_by_load[load], max_tokens, speculation_params,
                                           clients.get(load), varied)
        return rate, outputs, phases.summary()

    async def run():
        results = {}
        async with engine:
            # every run once untimed first, both ways: a path's first steps pay one-time costs (a new shape's matmul
            # heuristics, pinned buffers, and the graphs of spans longer than the floor, captured as sequences
            # reach them), which would otherwise fall on whichever timed run met them first, mostly speculation's
            for load, prompts in prompts_by_load.items():
                for params in (SpeculationParams(), speculation_by_load[load]):
                    # one round (a client's first request) meets the shapes
                    await generate_all(engine, prompts[: clients.get(load)], max_tokens, params, varied=varied)
            for load, prompts in prompts_by_load.items():
                plain, plain_out, plain_steps = await timed_run(load, SpeculationParams())
                drafted = copy.deepcopy(engine.stats_by_method.get(method))
                spec, spec_out, spec_steps = await timed_run(load, speculation_by_load[load])
                stats, before = engine.stats_by_method.get(method), drafted or SpecDecodeStats()
                rows = stats.num_drafts - before.num_drafts if stats else 0
                drafts = "; no drafts verified"
                if rows:
                    long = (stats.num_draft_tokens - before.num_draft_tokens) / rows
                    accepted = (stats.num_accepted_tokens - before.num_accepted_tokens) / rows
                    drafts = f"; {rows} drafts verified, {long:.1f} tokens long, {accepted:.2f} accepted"
                same = sum(a == b for a, b in zip(plain_out, spec_out, strict=True))
                steps = f"none {plain_steps}, {method} {spec_steps}{drafts}"
                results[load] = (plain, spec, same, len(prompts), steps)
        graphs = getattr(engine.runner, "graphs", None)
        if graphs is not None:
            print(f"  ({len(graphs)} step graphs, captured in {graphs.capture_seconds:.1f} s; attention "
                  f"{getattr(engine.runner, 'attention_forms', 'not measured')})", flush=True)
        for kind in ("chain", "tree"):
            drafting = getattr(engine.proposers.get(method), f"{kind}_graphs", None)
            if drafting is not None:
                print(f"  ({len(drafting)} {method} {kind} graphs, captured in {drafting.capture_seconds:.1f} s)",
                      flush=True)
        return results

    with phases:
        return asyncio.run(run())


def captured_matches_eager(model_spec: str, device: torch.device, prompts: Sequence[Sequence[int]],
                           max_tokens: int) -> tuple[int, int]:
    """In float32, where padding a batch barely moves a logit: (greedy outputs of captured forwards identical to
    eager ones, prompts). A wrong graph (stale inputs, a misplaced write) shows here as garbage."""
    loaded = load_model(model_spec, device=str(device), dtype="float32")
    outputs = []
    for eager in (True, False):
        options = LocalEngineOptions(model=model_spec, device=str(device), dtype="float32", max_num_seqs=len(prompts),
                                     enforce_eager=eager)
        engine, _ = build_local_engine(options, loaded)

        async def run(engine=engine):
            async with engine:
                return (await generate_all(engine, prompts, max_tokens, SpeculationParams()))[1]

        outputs.append(asyncio.run(run()))
    return sum(a == b for a, b in zip(*outputs, strict=True)), len(prompts)


def transformers_row(loaded: LoadedModel, prompt: Sequence[int], max_tokens: int) -> float:
    model = loaded.model
    ids = torch.tensor([list(prompt)], device=next(model.parameters()).device)
    model.generate(ids, max_new_tokens=8, do_sample=False)
    started = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - started)


def print_throughput(method: str, results: dict[str, tuple[float, float, int, int, str]]) -> None:
    for load, (plain, spec, same, total, steps) in results.items():
        label = f"code edit, 1 request{load[4:]}" if load.startswith("edit") else f"{load} concurrent chat"
        print(f"  {label:>22}: none {plain:7.1f} tok/s, {method} {spec:7.1f} tok/s ({spec / plain:.2f}x); "
              f"greedy identical {same}/{total}\n  {'':>22}  ({steps})", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.accelerator_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--eagle", nargs="*", choices=EAGLE_ROWS, default=["eagle", "eagle3", "eagle3-tree"],
                        help="the captured mode's EAGLE rows: a shipped head's chains (K = 4), or its EAGLE-2 trees "
                             f"({TREE_NODES} tokens, top-{TREE_TOPK}, depth 4); none: --eagle alone")
    parser.add_argument("--no-eagle", dest="eagle", action="store_const", const=[], help="no EAGLE rows")
    parser.add_argument("--rounds", type=int, default=1,
                        help="requests each client of a chat load sends, each as its last ends (1: the load's chats "
                             "all at once, one closed batch; more: a steady load, rows ending and starting apart)")
    parser.add_argument("--method", choices=("ngram", "suffix"), default=None,
                        help="the drafter of the speculation rows (default: serve's, suffix where it installs)")
    add_lengths_argument(parser)
    args = parser.parse_args(argv)
    args.method = args.method or first_runnable(SERVE_PREFERENCE, NGRAM)[0]
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    device = next(loaded.model.parameters()).device
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    print(f"model: {loaded.model_id} on {device}, {next(loaded.model.parameters()).dtype}; torch {torch.__version__}")
    prompt = tuple(loaded.tokenizer(PROMPT)["input_ids"])
    chats = [chat_token_ids(loaded.tokenizer, m) for m in chat_prompt_messages()]  # 48; more loads repeat them
    prompts_by_load = {str(n): [chats[i % len(chats)] for i in range(n * args.rounds)] for n in args.loads}
    clients = {str(n): n for n in args.loads}
    if args.rounds > 1:
        print(f"each client of a chat load sends {args.rounds} requests, each as its last ends")
    varied = args.lengths == "varied"
    print(f"chats ask for {'from ' if varied else ''}{args.max_tokens} tokens"
          + (f" down to {args.max_tokens - args.max_tokens // 2 + 1}, each its own (--lengths)" if varied else " each"))
    if args.method == "suffix":
        print("suffix: each request's own tree only (suffix_decoding_max_cached_requests 0): the prompts repeat")
    prompts_by_load["edit"] = [chat_token_ids(loaded.tokenizer, code_edit_message())]
    prompts_by_load[EDIT_LONG] = prompts_by_load["edit"]
    if device.type != "cpu":
        same, total = captured_matches_eager(args.model, device, chats[:8], args.max_tokens)
        print(f"captured vs eager forwards, float32, 8 chats: greedy outputs identical {same}/{total}")
    rows = {}
    for mode in args.modes:
        runner = mode_runner(loaded, mode)
        steps = asyncio.run(profile_runner(runner, prompt, args.max_tokens, 3))
        step_ms = statistics.median(run["step"] for run in steps)
        forward_ms = statistics.median(run["forward"] for run in steps)
        del runner
        counts = {}
        if device.type == "cuda":
            try:
                counts = step_counts(loaded, mode, prompt, 32)
            except Exception as error:  # noqa: BLE001 - the profiler's view is a figure, not the benchmark
                print(f"[{mode}] torch.profiler counts failed: {error!r}")
        # prefix caching off: the speculative run follows the plain one over the same prompts, and would find
        # their prefill cached
        options = LocalEngineOptions(model=args.model, device=args.device, dtype=args.dtype,
                                     max_num_seqs=max(args.loads), enable_prefix_caching=False,
                                     enforce_eager=mode == "eager",
                                     batch_invariant=mode == "invariant",
                                     speculative_config=speculation_config(args.method))
        rows[mode] = (step_ms, forward_ms, counts, throughput(loaded, options, prompts_by_load, args.max_tokens,
                                                              {EDIT_LONG: LONG_K}, clients, varied))
        print(f"\n[{mode}] decode step at batch 1: {step_ms:.2f} ms (forward {forward_ms:.2f})"
              + "".join(f", {v:.1f} {k}" for k, v in counts.items()) + (" per step" if counts else ""), flush=True)
        print_throughput(args.method, rows[mode][3])
        for row in args.eagle if mode == "captured" else ():
            tree = row.endswith("-tree")
            eagle = replace(options, speculative_config=SpeculativeConfig(
                method=row.removesuffix("-tree"), num_speculative_tokens=4, draft_device=str(device),
                draft_dtype=args.dtype, **({"num_draft_tokens": TREE_NODES, "eagle_topk": TREE_TOPK} if tree else {})))
            chains = {load: prompts for load, prompts in prompts_by_load.items() if load != EDIT_LONG}
            nodes = {load: TREE_NODES for load in chains} if tree else None  # a request's K is its tree's budget
            print_throughput(row, throughput(loaded, eagle, chains, args.max_tokens, nodes, clients, varied))
    if "eager" in rows and "captured" in rows:
        eager, captured = rows["eager"], rows["captured"]
        print(f"\ncaptured vs eager: step {eager[0] / captured[0]:.2f}x faster; tok/s without speculation "
              + ", ".join(f"{load}: {captured[3][load][0] / eager[3][load][0]:.2f}x" for load in eager[3])
              + (" (on CPU both run the same eager forward: these ratios are noise)" if device.type == "cpu" else ""))
    print(f"\ntransformers generate, batch 1: {transformers_row(loaded, prompt, args.max_tokens):.1f} tok/s")
    if "invariant" in rows and any(same < total for _, _, same, total, _ in rows["invariant"][3].values()):
        print("batch-invariant mode: a speculative greedy output differs from the non-speculative one")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
