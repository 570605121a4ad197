"""What the HTTP path costs a client on top of the engine: engine_host_cost's scripted engine behind the real
verifier server and a real gateway process, driven through POST /v1/completions, against the same engine in
process.

Run: `python -m services.bench.http_host_cost [--rows 1 8 64] [--tokens 128] [--text chat] [--stream]
[--simulated-step-ms 2.4 0.035 0.002] [--rounds 2]`. The verifier (start_verifier, its loop on this process's main
thread) serves a ScriptedRunner whose forwards sleep the simulated device step; a gateway process (`specserve
gateway`, on one shared GenerateMany stream as `specserve serve` starts it) fronts it, with the default model's
tokenizer; a client process sends `rows` greedy token-id completions at once (streamed with `--stream`), a round
unmeasured and then `--rounds` measured. Printed per row count, without speculation: tokens/s in process
(engine_host_cost.run_case) and through HTTP, their ratio, the wall time of a step, and the CPU time each process
spent per 1,000 tokens over the measured rounds (the gateway's, the client's, the verifier loop thread's). Every
answer's token ids (vLLM's return_token_ids) are checked against the script.

Why: issue 29 asks for 2,500 tokens/s at 64 concurrent requests through HTTP on an accelerator whose captured
step the simulated one imitates; the engine alone makes about 8,000 there (H200, stop 53). What the gateway and
the two links add per token decides whether the HTTP rows can get near the engine's, and the CPU per 1,000 tokens
carries over to machines with more cores than this bench's, where the wall times do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from services.bench.engine_host_cost import run_case
from services.bench.hardware import describe_hardware
from services.bench.http_runs import free_ports
from services.bench.scripted_model import Script, SimulatedDevice, add_client_load_arguments, simulated_device
from services.bench.verifier_stream_cost import start_scripted_verifier
from services.modeling.registry import DEFAULT_MODEL
from services.supervision import cpu_seconds

HEALTHY_WITHIN_S = 120.0  # the gateway loads its tokenizer, then finds the verifier


async def through_http(rows: int, tokens: int, vocab: int, text: str, simulated: SimulatedDevice | None,
                       rounds: int, stream: bool) -> dict[str, float]:
    """The scripted engine behind a real verifier and a gateway process; a client process sends the requests
    (see the docstring)."""
    verifier, runner = await start_scripted_verifier(rows, Script(text, vocab), simulated)
    port = free_ports(1)[0]
    with tempfile.TemporaryFile("w+") as log:
        gateway = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "gateway", "--port", str(port), "--model", DEFAULT_MODEL,
            "--verifier", f"127.0.0.1:{verifier.port}", "--verifier-shared-stream", stdout=log, stderr=log)
        try:
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.bench.http_host_cost", "--client", str(port), "--rows", str(rows),
                "--tokens", str(tokens), "--vocab", str(vocab), "--text", text, "--rounds", str(rounds),
                *(["--stream"] if stream else []), stdout=subprocess.PIPE)
            line = await client.stdout.readline()  # "measuring": healthy, and the unmeasured round is done
            if line.strip() != b"measuring":
                await client.wait()
                log.seek(0)
                raise RuntimeError(f"the client process failed (exit {client.returncode}); the gateway's log:\n"
                                   f"{log.read()[-3000:]}")
            forwards, forward_s = runner.forwards, runner.forward_s
            loop_cpu, gateway_cpu = time.thread_time(), cpu_seconds(gateway.pid)
            measured = json.loads(await client.stdout.readline())
            loop_cpu, gateway_cpu = time.thread_time() - loop_cpu, cpu_seconds(gateway.pid) - gateway_cpu
            if await client.wait():
                raise RuntimeError(f"the client process failed (exit {client.returncode})")
        finally:
            if gateway.returncode is None:
                gateway.terminate()
            await gateway.wait()
            await verifier.stop()
    steps = runner.forwards - forwards
    per_k = 1000 / measured["tokens"]
    return {"tokens": measured["tokens"], "follows_script": measured["follows_script"],
            "tokens_per_s": measured["tokens"] / measured["seconds"], "forwards": steps,
            "step_ms": 1000 * measured["seconds"] / steps,
            "forward_ms": 1000 * (runner.forward_s - forward_s) / steps,
            "gateway_cpu_ms": 1000 * gateway_cpu * per_k, "client_cpu_ms": 1000 * measured["cpu_s"] * per_k,
            "loop_cpu_ms": 1000 * loop_cpu * per_k}


async def client(port: int, rows: int, tokens: int, vocab: int, text: str, rounds: int, stream: bool
                 ) -> dict[str, float]:
    """The application's part: waits for the gateway's /health, then `rows` completions at once, a round
    unmeasured, then `rounds`; each answer's token ids (vLLM's return_token_ids) are checked against the script's
    continuation. (Not its text: a random token after the prompt's may complete the prompt's last character, which
    the gateway then rightly does not repeat in the output's text.)"""
    import httpx

    script = Script(text, vocab)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=rows + 1)) as http:
        deadline = time.monotonic() + HEALTHY_WITHIN_S
        while True:
            try:
                if (await http.get("/health")).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway was not healthy within {HEALTHY_WITHIN_S:.0f} s")
            await asyncio.sleep(0.2)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt: Sequence[int]) -> list[int]:
            """The completion's token ids"""
            body = {"model": model, "prompt": list(prompt), "max_tokens": tokens, "temperature": 0.0,
                    "return_token_ids": True}
            if not stream:
                response = await http.post("/v1/completions", json=body)
                response.raise_for_status()
                return response.json()["choices"][0]["token_ids"]
            output = []
            async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        output += [t for choice in json.loads(line[6:])["choices"] for t in choice["token_ids"]]
            return output

        async def round_of(first: int) -> list[tuple[tuple[int, ...], list[int]]]:
            """(prompt, output) per request"""
            prompts = [script.prompt(first + i) for i in range(rows)]
            return list(zip(prompts, await asyncio.gather(*(one(p) for p in prompts)), strict=True))

        await round_of(0)
        print("measuring", flush=True)
        cpu, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        answers = []
        for r in range(rounds):
            answers += await round_of((r + 1) * rows)
        seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
        return {"tokens": sum(len(output) for _, output in answers), "seconds": seconds,
                "cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
                "follows_script": all(len(output) == tokens and script.continues(prompt, output)
                                      for prompt, output in answers)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.http_host_cost",
                                     description=__doc__.split("\n")[0])
    add_client_load_arguments(parser, rows=[1, 8, 64], tokens=128)
    parser.add_argument("--stream", action="store_true", help="stream the completions (server-sent events)")
    args = parser.parse_args(argv)
    if args.client is not None:
        figures = asyncio.run(client(args.client, args.rows[0], args.tokens, args.vocab, args.text, args.rounds,
                                     args.stream))
        print(json.dumps(figures), flush=True)
        return 0
    simulated = simulated_device(args)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    print(f"simulated device step: {simulated}; {'streamed' if args.stream else 'whole'} completions")
    for rows in args.rows:
        local = asyncio.run(run_case(rows, False, args.tokens, args.vocab, text=args.text, simulated=simulated,
                                     rounds=args.rounds))
        in_process = local["tokens"] / local["seconds"]
        remote = asyncio.run(through_http(rows, args.tokens, args.vocab, args.text, simulated, args.rounds,
                                          args.stream))
        print(f"{rows:>3} rows: {in_process:7.0f} tok/s in process ({local['forwards']} forwards), "
              f"{remote['tokens_per_s']:7.0f} through HTTP ({remote['forwards']}; "
              f"{remote['tokens_per_s'] / in_process:.2f}x); a step took {remote['step_ms']:.2f} ms of wall around "
              f"a {remote['forward_ms']:.2f} ms forward; CPU ms per 1,000 tokens: gateway "
              f"{remote['gateway_cpu_ms']:.0f}, client {remote['client_cpu_ms']:.0f}, verifier loop "
              f"{remote['loop_cpu_ms']:.0f}"
              + ("" if local["follows_script"] and remote["follows_script"] else " (OUTPUT DIFFERS FROM THE SCRIPT)"),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
