"""What the verifier's output streams cost its engine: engine_host_cost's scripted engine behind the real gRPC
server, its requests on a Generate call each or on one GenerateMany call, against the same engine in process.

Run: `python -m services.bench.verifier_stream_cost [--rows 8 64] [--tokens 256] [--text chat]
[--simulated-step-ms 2.4 0.035 0.002] [--rounds 2]`. The verifier (start_verifier, its loop on this process's main
thread) serves a ScriptedRunner whose forwards sleep the simulated device step; a client process, in the gateway's
place, sends `rows` greedy requests at once, a round unmeasured and then `--rounds` measured, each on a Generate
call of its own, then again all of a round's on one GenerateMany call. Printed per row count, without
speculation: tokens/s in process (engine_host_cost.run_case) and for each way through gRPC, with, over the measured
rounds, the wall time a step took against its forward's (device) time and the verifier loop thread's CPU a step.
Every output is checked against the script.

Why: the verifier's asyncio loop runs the engine's steps and also the calls' sends, and a Generate call sends one
message per request per step at tens of microseconds of grpc.aio each, holding the interpreter lock the compute
thread needs to start a forward. On a 2-core EPYC with the H200's simulated step, 64 requests ran at 0.60-0.75x of
the engine in process on a call each and 0.81-0.93x on one GenerateMany call (the gateway's
--verifier-shared-stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from types import SimpleNamespace

from services.bench.engine_host_cost import run_case
from services.bench.hardware import describe_hardware
from services.bench.scripted_model import (Script, ScriptedRunner, SimulatedDevice, add_client_load_arguments,
                                           simulated_device)
from services.common import protos


async def start_scripted_verifier(rows: int, script: Script, simulated: SimulatedDevice | None):
    """A real verifier server (a free port, its loop this process's) serving a ScriptedRunner of `rows` slots:
    (the running verifier, the runner)."""
    from services.verifier.server import start_verifier
    from services.verifier.settings import VerifierSettings

    runner = ScriptedRunner(rows, script, simulated=simulated)
    facts = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=runner.max_model_len))  # the model's
    settings = VerifierSettings(port=0, metrics_port=0, max_num_seqs=rows, max_model_len=runner.max_model_len)
    return await start_verifier(facts, "scripted", settings, runner=runner), runner


async def through_grpc(rows: int, tokens: int, vocab: int, text: str, simulated: SimulatedDevice | None,
                       rounds: int, many: bool = False) -> dict[str, float]:
    """The scripted engine served by a real verifier; a client process streams the requests (see the docstring),
    on a Generate stream each or (`many`) on one GenerateMany stream a round."""
    verifier, runner = await start_scripted_verifier(rows, Script(text, vocab), simulated)
    try:
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.bench.verifier_stream_cost", "--client", str(verifier.port),
            "--rows", str(rows), "--tokens", str(tokens), "--vocab", str(vocab), "--text", text,
            "--rounds", str(rounds), *(["--many"] if many else []), stdout=subprocess.PIPE)
        await client.stdout.readline()  # "measuring": the unmeasured round is done
        forwards, forward_s, cpu, started = runner.forwards, runner.forward_s, time.thread_time(), time.perf_counter()
        measured = json.loads(await client.stdout.readline())
        seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
        if await client.wait():
            raise RuntimeError(f"the client process failed (exit {client.returncode})")
        steps = runner.forwards - forwards
        return {"tokens": measured["tokens"], "follows_script": measured["follows_script"],
                "tokens_per_s": measured["tokens"] / measured["seconds"], "step_ms": 1000 * seconds / steps,
                "forward_ms": 1000 * (runner.forward_s - forward_s) / steps, "loop_cpu_ms": 1000 * cpu / steps}
    finally:
        await verifier.stop()


async def client(port: int, rows: int, tokens: int, vocab: int, text: str, rounds: int, many: bool) -> dict[str, float]:
    """The gateway's part: `rows` requests at once, a round unmeasured, then `rounds`; each request on a Generate
    stream of its own, or (`many`) all of a round's on one GenerateMany stream."""
    import grpc

    pb, pb_grpc = protos.load("verifier")
    script = Script(text, vocab)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.VerifierStub(channel)

        def request(name: str, offset: int):
            return pb.GenerateRequest(
                request_id=name, prompt_token_ids=script.prompt(offset),
                sampling=pb.SamplingParams(max_tokens=tokens, temperature=0.0),
                speculation=pb.SpeculationParams(method="none"))

        async def one(sent) -> list[int]:
            return [t async for message in stub.Generate(sent) for t in message.token_ids]

        async def round_of(tag: str, first: int) -> list[tuple[int, bool]]:
            """(tokens generated, whether they are the script's continuation of the prompt) per request"""
            sent = [request(f"{tag}-{i}", first + i) for i in range(rows)]
            if many:
                outputs: dict[str, list[int]] = {r.request_id: [] for r in sent}
                async for message in stub.GenerateMany(iter([pb.StreamRequest(start=r) for r in sent])):
                    for update in message.updates:
                        if update.HasField("error"):
                            raise RuntimeError(f"{update.request_id}: {update.error.message}")
                        outputs[update.request_id] += update.output.token_ids
                answers = [outputs[r.request_id] for r in sent]
            else:
                answers = await asyncio.gather(*(one(r) for r in sent))
            return [(len(out), script.continues(r.prompt_token_ids, out))
                    for r, out in zip(sent, answers, strict=True)]

        await round_of("warm", 0)
        print("measuring", flush=True)
        started = time.perf_counter()
        answers = []
        for r in range(rounds):
            answers += await round_of(f"run-{r}", r * rows)
        return {"tokens": sum(n for n, _ in answers), "seconds": time.perf_counter() - started,
                "follows_script": all(followed for _, followed in answers)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.verifier_stream_cost",
                                     description=__doc__.split("\n")[0])
    add_client_load_arguments(parser, rows=[8, 64], tokens=256)
    parser.add_argument("--many", action="store_true", help=argparse.SUPPRESS)  # ... on one GenerateMany stream
    args = parser.parse_args(argv)
    if args.client is not None:
        figures = asyncio.run(client(args.client, args.rows[0], args.tokens, args.vocab, args.text, args.rounds,
                                     args.many))
        print(json.dumps(figures), flush=True)
        return 0
    simulated = simulated_device(args)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    print(f"simulated device step: {simulated}")
    for rows in args.rows:
        local = asyncio.run(run_case(rows, False, args.tokens, args.vocab, text=args.text, simulated=simulated,
                                     rounds=args.rounds))
        in_process = local["tokens"] / local["seconds"]
        print(f"{rows:>3} rows, no speculation: {in_process:7.0f} tok/s in process", flush=True)
        for many in (False, True):
            remote = asyncio.run(through_grpc(rows, args.tokens, args.vocab, args.text, simulated, args.rounds, many))
            print(f"{rows:>3} rows, {'one GenerateMany stream' if many else 'a Generate stream a request'}: "
                  f"{remote['tokens_per_s']:7.0f} tok/s ({remote['tokens_per_s'] / in_process:.2f}x in process); a "
                  f"step took {remote['step_ms']:.2f} ms of wall around a {remote['forward_ms']:.2f} ms forward, "
                  f"{remote['loop_cpu_ms']:.2f} ms of the loop thread's CPU"
                  + ("" if local["follows_script"] and remote["follows_script"] else " (OUTPUT DIFFERS FROM THE SCRIPT)"),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
