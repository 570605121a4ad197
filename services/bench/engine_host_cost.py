"""What the engine's own host work costs a step, with the model taken out: the ceiling a fast accelerator meets.

Run: `python -m services.bench.engine_host_cost [--rows 1 8 64] [--tokens 256] [--text novel|chat|mixed]
[--method suffix] [--link] [--simulated-step-ms BASE ROW TOKEN] [--rounds R] [--lengths varied|equal]
[--after-burst N]`. On an H100
SmolLM2's captured step takes about 5 ms, so what the engine does around it (planning, drafting, sampling on the
host, committing, the asyncio loop) decides the throughput at high concurrency. Here the engine drives a
ScriptedRunner: a "model" that answers instantly with logits that continue a fixed token script, so that the time
measured is the engine's own, and n-gram drafts from the context are accepted. Printed per row count, without
speculation and with ngram (K = 4; `--method suffix`: the suffix drafter): tokens/s, forwards, and host ms per
forward; with speculation also the decode-only steps by kind (asked, probed, plain) as the planner predicted them
and as they came (plan_audit.py).

`--text novel` scripts text that never repeats, so the n-gram drafter never has a draft (new chat text, where it
mostly has none): what speculation costs where it cannot pay, which adaptive speculation should keep near nothing.
`--text chat` scripts the case between them that new chat text is (scripted_model.py): about half the rows have an
n-gram draft and a token or two of it is accepted. `--simulated-step-ms BASE ROW TOKEN` sleeps a device step time
of that shape in each forward, as a host waits on its accelerator (`2.4 0.035 0.002`: the H200's captured
SmolLM2-135M step), so that speculation against none is weighed as on that device, on a machine without one.
`--link` reaches the drafter as deployed, a `specserve drafter` process over gRPC, so each drafting call costs a
round trip (in process, the lookup alone). `--text mixed` is a server's mixed traffic (one request in 8 repeats, as
a code edit does, the others chat): since the batch's rate is the chats' pace, it also prints each kind's median
request latency against no speculation (eagle-sim's `--repeating-accept` is its chance on the repeating ones).

The requests' outputs are read as the verifier reads them for `specserve serve`'s gateway, one GenerateMany call's
(muxed_clients.py); `--per-request-streams` reads them with a task a request, as a Generate call each would.

The vocabulary is small by default (--vocab 512): on a CPU the sampling and verification over the vocabulary run
as host math, where an accelerator runs them as kernels and the host pays only to launch each one. With a small
vocabulary each tensor operation costs about its dispatch, as a launch does, so what is measured is the host's
part of an accelerator's step. `--vocab 49152` (SmolLM2's) shows the CPU's own case instead. With a simulated
device a plain decode step verifies inside the simulated graph, as a captured step on an accelerator does
(ScriptedRunner.forward_with_tail): the host packs the verification's inputs and reads one result, and the
eager verification runs only where a GPU's would (prompt chunks, logprobs, grammars, trees).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import statistics
import time
from collections.abc import Sequence

from services.bench.drafter_process import drafter_process
from services.bench.hardware import describe_hardware
from services.bench.muxed_clients import MuxedClients
from services.bench.request_lengths import add_lengths_argument, request_tokens
from services.common.speculative_config import SpeculativeConfig
from services.bench.scripted_drafter import EagleLike, SimulatedAsk
from services.bench.scripted_model import (SCRIPT_PERIOD, SCRIPTS, ScriptedRunner, Script, SimulatedDevice,
                                           add_simulated_verify_argument, simulated_device)
from services.inprocess import local_proposers
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from services.verifier.spec_stats import SpecDecodeStats

EAGLE_SIM = "eagle-sim"  # the method name of the EAGLE-like scripted drafter


async def run_case(rows: int, speculate: bool, tokens: int, vocab: int, adaptive: bool = True,
                   drafter: str | None = None, text: str = "repeating", simulated: SimulatedDevice | None = None,
                   rounds: int = 1, burst: int = 0, method: str = "ngram", eagle_like: EagleLike | None = None,
                   per_request_streams: bool = False, varied_lengths: bool = False) -> dict[str, float]:
    """`rows` greedy requests of `tokens` each, all at once, after one unmeasured round. adaptive: the engine's
    default adaptive speculation, whose K follows the step costs it measures (so the number of forwards depends on
    the machine and its load); False: K = 4 at every step. text: the script (scripted_model.SCRIPTS; novel text
    must fit each request's prompt and output in the vocabulary). drafter: the address of a drafter process
    to reach over gRPC; None: the lookup in process. simulated: a device step time slept in each forward (None:
    the forward answers at once). rounds: each of the `rows` clients sends that many requests, each as the one
    before ends, so that rows finish and start at different steps as under a steady load (1: one closed batch,
    whose last steps run the rows that were slowest alone). burst: that many requests at once before the measured
    ones (after the warm-up round), so that what the engine learned from a larger batch is what it starts the
    measured rows with. method: the drafter, ngram or suffix (serve's default where arctic-inference is
    installed). eagle_like: instead, an EAGLE-like drafter in process (scripted_drafter.py, method "eagle-sim":
    its ask's time simulated, the link included), the runner returning target states of its width.
    varied_lengths: each request asks for its own number of tokens (request_lengths.py) instead of `tokens` each.
    per_request_streams: read each request's outputs with a task of its own (a Generate call a request) instead of
    as one GenerateMany call's (muxed_clients.py, the deployed path)."""
    script = Script(text, vocab)
    state_width = eagle_like.state_width if eagle_like is not None else 1
    runner = ScriptedRunner(max(rows, burst), script, simulated=simulated, state_width=state_width)
    if eagle_like is not None:
        method = EAGLE_SIM
        proposers = {method: eagle_like.drafter(script)}
    elif drafter is None:
        proposers = local_proposers(SpeculativeConfig(method=method, num_speculative_tokens=4))
    else:
        proposers = {method: RemoteProposer(RemoteProposerConfig(drafter, vocab), method=method)}
    calls = CountedCalls(proposers[method])
    proposers[method].propose = calls
    engine = Engine(runner, EngineConfig(adaptive_speculation=adaptive), proposers)
    speculation = SpeculationParams(method, 4) if speculate else SpeculationParams()

    latencies: dict[int, float] = {}  # by request offset, the measured requests' seconds from sent to done

    async def one(name: str, offset: int) -> list[int]:
        prompt = script.prompt(offset)
        sent = time.perf_counter()
        sampling = SamplingParams(max_tokens=request_tokens(offset, tokens, varied_lengths), temperature=0.0)
        request = GenerationRequest(name, prompt, sampling, speculation)
        if clients is not None:
            out = await clients.generate(request)
        else:
            out = []
            async for output in engine.generate(request):
                out += output.token_ids
        latencies[offset] = time.perf_counter() - sent
        return out

    async with engine, contextlib.AsyncExitStack() as readers:
        clients = None if per_request_streams else await readers.enter_async_context(MuxedClients(engine))
        await asyncio.gather(*(one(f"warm-{i}", i) for i in range(rows)))
        await asyncio.gather(*(one(f"burst-{i}", i) for i in range(burst)))
        forwards, forward_s, started = runner.forwards, runner.forward_s, time.perf_counter()
        asked, rows_asked = calls.count, calls.rows
        captured = runner.captured_forwards
        before = copy.deepcopy(engine.stats_by_method.get(method)) or SpecDecodeStats()
        engine.planner.audit.reset()

        async def client(i: int) -> list[tuple[int, list[int]]]:
            return [(offset, await one(f"run-{offset}", offset)) for offset in range(i, rows * rounds, rows)]

        outputs = [answer for answers in await asyncio.gather(*(client(i) for i in range(rows))) for answer in answers]
        seconds = time.perf_counter() - started
        after = engine.stats_by_method.get(method) or SpecDecodeStats()
    if drafter is not None:
        await proposers[method].close()
    elif eagle_like is not None:
        proposers[method].close()
    steps = runner.forwards - forwards
    return {"tokens": sum(len(out) for _, out in outputs), "seconds": seconds, "forwards": steps,
            "captured_forwards": runner.captured_forwards - captured,
            "drafter_calls": calls.count - asked, "rows_asked": calls.rows - rows_asked,
            "drafts": after.num_drafts - before.num_drafts,
            "draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "accepted": after.num_accepted_tokens - before.num_accepted_tokens,
            "host_ms_per_forward": 1000 * (seconds - (runner.forward_s - forward_s)) / max(steps, 1),
            "follows_script": all(script.continues(script.prompt(offset), out) for offset, out in outputs),
            "repeating_request_s": median_latency(latencies, [o for o, _ in outputs if script.repeats(o)]),
            "other_request_s": median_latency(latencies, [o for o, _ in outputs if not script.repeats(o)]),
            "plans": engine.planner.audit.describe()}


def median_latency(latencies: dict[int, float], offsets: Sequence[int]) -> float:
    """The median seconds of the requests numbered `offsets` (0.0 for none)."""
    return statistics.median(latencies[offset] for offset in offsets) if offsets else 0.0


class CountedCalls:
    """A proposer's propose(), counting the calls the engine makes and the rows they ask (set as the proposer's own
    `propose`, so that everything else the engine reads of the proposer is the proposer's)."""

    def __init__(self, proposer) -> None:
        self.propose = proposer.propose
        self.count = 0
        self.rows = 0

    async def __call__(self, inputs):
        self.count += 1
        self.rows += len(inputs)
        return await self.propose(inputs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.engine_host_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--text", choices=SCRIPTS, default="repeating")
    parser.add_argument("--method", choices=("ngram", "suffix", EAGLE_SIM), default="ngram",
                        help="the drafter (suffix: serve's default where arctic-inference is installed; eagle-sim: an "
                             "EAGLE-like drafter in process, its asks taking --simulated-ask-ms)")
    parser.add_argument("--link", action="store_true", help="the drafter as a process, over gRPC")
    parser.add_argument("--per-request-streams", action="store_true",
                        help="read each request's outputs with a task of its own, as a Generate call a request does "
                             "(default: as one GenerateMany call, the stream `specserve serve` deploys)")
    parser.add_argument("--after-burst", type=int, default=0, metavar="N",
                        help="serve N requests at once before the measured rows (on the same engine)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="requests each of the rows' clients sends, one after the other (1: one closed batch)")
    add_lengths_argument(parser)
    parser.add_argument("--simulated-step-ms", type=float, nargs=3, metavar=("BASE", "ROW", "TOKEN"),
                        help="sleep a device step time in each forward: BASE ms + ROW ms a row beyond the first + "
                             "TOKEN ms a token beyond one a row (the H200's captured step: 2.4 0.035 0.002)")
    add_simulated_verify_argument(parser)
    default_ask, default_eagle = SimulatedAsk(), EagleLike()
    parser.add_argument("--simulated-ask-ms", type=float, nargs=2, metavar=("BASE", "ROW"),
                        default=[default_ask.base_ms, default_ask.row_ms],
                        help="eagle-sim: an ask's time, BASE ms + ROW ms a sequence beyond the first (default: the "
                             "H200's EAGLE-3 chain of 4 over gRPC)")
    parser.add_argument("--simulated-opening-ms", type=float, default=default_ask.opening_ms,
                        help="eagle-sim: what an ask takes more for each sequence it asks about for the first time "
                             "(default none)")
    parser.add_argument("--accept", type=float, default=default_eagle.accept,
                        help="eagle-sim: the chance a draft position is right given the one before was")
    parser.add_argument("--repeating-accept", type=float, default=None,
                        help="eagle-sim on --text mixed: that chance on the requests that repeat (default: --accept)")
    parser.add_argument("--state-width", type=int, default=default_eagle.state_width,
                        help="eagle-sim: the target states' width a token (SmolLM2's EAGLE-3: 3 x 576)")
    args = parser.parse_args(argv)
    if args.link and args.method == EAGLE_SIM:
        parser.error("--method eagle-sim runs in process (its simulated ask includes the link): drop --link")
    eagle_like = (EagleLike(SimulatedAsk(*args.simulated_ask_ms, args.simulated_opening_ms), args.accept,
                            args.state_width, args.repeating_accept) if args.method == EAGLE_SIM else None)
    if args.text == "novel" and args.vocab < 2 * SCRIPT_PERIOD + max(args.rows) * args.rounds + args.tokens:
        parser.error("--text novel needs a vocabulary larger than a request's prompt and output (raise --vocab)")
    simulated = simulated_device(args) if args.simulated_step_ms else None
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    if simulated is not None:
        print(f"simulated device step: {simulated}")
    if eagle_like is not None:
        print(f"simulated EAGLE-like drafter: {eagle_like}")
    with contextlib.ExitStack() as stack:
        drafter = None
        if args.link:
            drafter, _ = stack.enter_context(drafter_process(["--method", args.method, "--num-speculative-tokens", "4"],
                                                             lambda message: print(message, flush=True)))
        for rows in args.rows:
            rates, latency = {}, {}
            for speculate in (False, True):
                figures = asyncio.run(run_case(rows, speculate, args.tokens, args.vocab, drafter=drafter,
                                               text=args.text, simulated=simulated, rounds=args.rounds,
                                               burst=args.after_burst, method=args.method, eagle_like=eagle_like,
                                               per_request_streams=args.per_request_streams,
                                               varied_lengths=args.lengths == "varied"))
                rates[speculate] = figures["tokens"] / figures["seconds"]
                latency[speculate] = figures
                drafts = figures["drafts"]
                verified = (f", {drafts} drafts verified ({figures['draft_tokens'] / drafts:.1f} tokens, "
                            f"{figures['accepted'] / drafts:.2f} accepted)" if drafts else "")
                print(f"{rows:>3} rows, {args.text} text, {f'{args.method} K=4' if speculate else 'no speculation'}"
                      f"{' over gRPC' if speculate and args.link else ''}: {rates[speculate]:7.0f} tok/s, "
                      f"{figures['forwards']} forwards, {figures['drafter_calls']} drafter calls "
                      f"({figures['rows_asked']} rows){verified}, "
                      f"{figures['host_ms_per_forward']:.2f} ms of host work a forward"
                      + ("" if figures["follows_script"] else " (OUTPUT DIFFERS FROM THE SCRIPT)"), flush=True)
                if speculate:
                    print(f"{'':>3}   decode-only steps as planned (plan_audit.py): {figures['plans']}", flush=True)
            if args.text == "mixed":  # a request's latency by kind: the batch's rate is the chats' pace
                for kind, key in (("repeating", "repeating_request_s"), ("chat", "other_request_s")):
                    print(f"{rows:>3} rows, mixed text: {kind} requests {1000 * latency[True][key]:.0f} ms each "
                          f"(median), {latency[False][key] / latency[True][key]:.2f}x as fast as without "
                          f"speculation", flush=True)
            rounds = f", {args.rounds} requests a client" if args.rounds > 1 else ""
            rounds += f", after a burst of {args.after_burst}" if args.after_burst else ""
            print(f"{rows:>3} rows, {args.text} text{rounds}: {args.method} / none {rates[True] / rates[False]:.2f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
