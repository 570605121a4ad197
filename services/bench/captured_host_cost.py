"""The host's part of a captured accelerator step, measured on a machine without an accelerator.

Run: `python -m services.bench.captured_host_cost [--rows 1 8 64] [--tokens 128] [--repeats 3]`.

On an accelerator a decode step replays one captured graph (step_graphs.py, captured_verify.py) and waits for it
once. Everything else in the step is host work that the device waits for: planning, drafting, building and
packing the forward's inputs, the tail's inputs, the copy into the graph's buffer, each row's rollback and
commit, and the asyncio loop. On an H200 that work was about half of a 64-row step (README, GPU section).

engine_host_cost.py does not measure this path. Its scripted runner has no graphs, so its steps take the eager
verification (sampling over the vocabulary on the host), which an accelerator never runs.

Here the engine drives a real LlamaFamilyRunner (a tiny random llama, so prefill costs next to nothing). Its step
graphs are captured by a backend whose replay does no work: HostOnlyReplay. The host work is the captured path's,
operation for operation, and the device's work is zero. A replayed verify writes "no draft accepted, token 0",
so speculative rows go on drafting and rolling back. This measures host work only: the tokens are not a model's.

Printed per row count: host ms per decode step (the wall time less --device-ms), without speculation and with
ngram (K = 4, adaptive speculation off, so that every step asks), and the process's CPU ms per step. Medians of
--repeats runs, alternated. With `--device-ms 0` every part of the step is serial; with a device time, the work
that can run while the device computes (the last step's sends, here each request's consumer) is off the critical
path if the engine lets it be.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from unittest import mock

import torch

from services.bench.hardware import describe_hardware
from services.common.speculative_config import SpeculativeConfig
from services.inprocess import local_proposers
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.host_copies import DeviceToHost
from services.modeling.step_graphs import StepGraphs, default_capture_sizes
from services.verifier import step_execution
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams

VOCAB = 2048
PROMPT_TOKENS = 40


class HostOnlyReplay:
    """A GraphBackend whose capture runs the forward once (for its static outputs) and whose replay does nothing,
    as a device's replay costs its host nothing but the launch. A verify tail's output (a graph's third output)
    is zeroed on replay: every row emits token 0 and accepts no draft. With `device_s`, the replay's results are
    ready that long after it, and the step's one wait (DeviceToHost.wait) sleeps until then, as a host waits on
    its device with the GIL released (simulated_waits installs that wait)."""

    def __init__(self, device_s: float = 0.0) -> None:
        self.verify_replays = 0  # replays of a graph with the verify tail (captured_verify.py): decode steps
        self.device_s = device_s
        self.ready_at = 0.0

    def capture(self, forward):
        outputs = forward()

        def replay() -> None:
            if len(outputs) == 3:
                self.verify_replays += 1
                outputs[2].zero_()
            self.ready_at = time.perf_counter() + self.device_s

        return replay, outputs

    @contextlib.contextmanager
    def simulated_waits(self) -> Iterator[None]:
        """While inside, a step's wait for its results lasts until the last replay's device time is over."""
        backend = self

        class WaitingForReplay(DeviceToHost):
            def wait(self) -> None:
                time.sleep(max(0.0, backend.ready_at - time.perf_counter()))
                super().wait()

        with mock.patch.object(step_execution, "DeviceToHost", WaitingForReplay):
            yield


def tiny_runner(max_num_seqs: int, max_model_len: int, device_s: float = 0.0
                ) -> tuple[LlamaFamilyRunner, HostOnlyReplay]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_model_len)
    runner = LlamaFamilyRunner(LlamaForCausalLM(config).eval(), max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len, pack_weights=False,
                               kv_cache=KVCacheConfig(memory_bytes=256 << 20, block_size=16))
    backend = HostOnlyReplay(device_s)
    runner.graphs = StepGraphs(runner._body, backend, default_capture_sizes(max_num_seqs), runner.device,
                               max_span=max_model_len, head=runner._head)
    return runner, backend


async def host_ms_per_step(rows: int, speculate: bool, tokens: int, device_ms: float = 0.0) -> tuple[float, float]:
    """Wall and CPU milliseconds (the process's, every thread's) per replayed step while `rows` greedy requests of
    `tokens` run at once, after one unmeasured round that captures the graphs the measured one replays. The CPU
    time is the steadier figure on a shared machine: a step's host work runs on one thread at a time."""
    runner, backend = tiny_runner(max(rows, 1), PROMPT_TOKENS + tokens + 64, device_ms / 1000)
    proposers = local_proposers(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    engine = Engine(runner, EngineConfig(adaptive_speculation=False, log_stats_interval_s=0), proposers)
    speculation = SpeculationParams("ngram", 4) if speculate else SpeculationParams()

    async def one(name: str, i: int) -> None:
        prompt = [(7 * i + 13 * j) % (VOCAB - 1) + 1 for j in range(PROMPT_TOKENS)]
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(GenerationRequest(name, prompt, sampling, speculation)):
            pass

    with backend.simulated_waits():
        async with engine:
            await asyncio.gather(*(one(f"warm-{i}", i) for i in range(rows)))
            replays, started, cpu = backend.verify_replays, time.perf_counter(), time.process_time()
            await asyncio.gather(*(one(f"run-{i}", i) for i in range(rows)))
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    steps = backend.verify_replays - replays
    if steps < tokens - 1:  # a decode step verified eagerly would measure another path
        raise RuntimeError(f"{steps} captured verify steps for {tokens} tokens a request: the captured path was "
                           "not taken")
    return 1000 * seconds / steps, 1000 * cpu_seconds / steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.captured_host_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="each replay sleeps this long (the GIL released), as the host waits on a device")
    args = parser.parse_args(argv)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    for rows in args.rows:
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for speculate in (False, True):
                runs[speculate].append(asyncio.run(host_ms_per_step(rows, speculate, args.tokens, args.device_ms)))
        for speculate, name in ((False, "no speculation"), (True, "ngram K=4")):
            wall, cpu = (statistics.median(run[i] for run in runs[speculate]) for i in (0, 1))
            print(f"{rows:>3} rows, {name}: host {wall - args.device_ms:.3f} ms a step (wall less the device's "
                  f"{args.device_ms:g}), {cpu:.3f} ms CPU (medians of {args.repeats}; host "
                  f"{', '.join(f'{run[0] - args.device_ms:.3f}' for run in runs[speculate])})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
