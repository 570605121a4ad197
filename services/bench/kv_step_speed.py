"""Decode-step speed of the paged KV cache's two read paths, and the verifier's memory against its weights and
pool, measured where the bench runs (part of `make bench-prefix`).

A decode step over B rows reads each row's cached positions either as a view of the pool, row by row, or as
one padded gather for the batch (attention_paths.py). Which is faster depends on the CPU, B and the context, so
the runner picks by the mean span read, at a threshold: this measures both paths at short and long contexts
with 1, 8 and 16 rows (median of alternating rounds, the same runner), and says which one the runner takes, so
the threshold can be checked on any machine.

Memory: resident set of this process with the model and its pool loaded, against the weights' bytes plus the
pool's; also the resident set of a bare interpreter that imports what a verifier imports, which a small model
cannot amortise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from services.bench.hardware import describe_hardware
from services.common.heap_trim import trim_heap
from services.common.process_memory import resident_bytes, vmrss
from services.modeling.attention_paths import AttentionPaths
from services.modeling.loading import load_model
from services.modeling.runner import RowInput
from services.modeling.runner_factory import create_runner

ROWS = (1, 8, 16)
CONTEXTS = (150, 1000)
ROUNDS = 3
STEPS = 8  # decode steps per round and path
IMPORT_BASELINE = ("import torch, grpc, llguidance, transformers.models.llama.modeling_llama; "
                   "print(open('/proc/self/status').read())")


@dataclass(frozen=True)
class StepSpeed:
    rows: int
    context: int
    row_by_row_ms: float
    gathered_ms: float
    runner_takes: str  # "row by row" or "gathered"


def step_speeds(runner, rows_list=ROWS, contexts=CONTEXTS, rounds: int = ROUNDS) -> list[StepSpeed]:
    """Both read paths on `runner` (a LlamaFamilyRunner with room for max(rows_list) sequences), one decode token
    per row over `context` cached positions each; its own path choice is restored afterwards."""
    chosen = runner.attention_paths
    paths = {"row by row": AttentionPaths(0), "gathered": AttentionPaths(float("inf"))}
    results = []
    try:
        for context in contexts:
            for rows in rows_list:
                ids = [f"step{rows}-{context}-{i}" for i in range(rows)]
                for i, seq in enumerate(ids):
                    runner.add_sequence(seq)
                    runner.forward([RowInput(seq, [(7 * j + 13 * i) % 1000 + 5 for j in range(context)], 1)])
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(rounds):
                    for name, path in paths.items():
                        runner.attention_paths = path
                        times[name].append(_median_step(runner, ids, context))
                runner.attention_paths = chosen
                for seq in ids:
                    runner.remove_sequence(seq)
                takes = "row by row" if chosen.row_by_row(rows, context + 1) else "gathered"
                results.append(StepSpeed(rows, context, statistics.median(times["row by row"]) * 1e3,
                                         statistics.median(times["gathered"]) * 1e3, takes))
    finally:
        runner.attention_paths = chosen
    return results


def _median_step(runner, ids: list[str], context: int) -> float:
    seconds = []
    for _ in range(STEPS):
        started = time.perf_counter()
        runner.forward([RowInput(seq, [11], 1) for seq in ids])
        seconds.append(time.perf_counter() - started)
        for seq in ids:
            runner.truncate(seq, context)
    return statistics.median(seconds)


def import_baseline_bytes() -> int:
    """Resident set of a fresh interpreter after importing what a verifier imports (no model, no pool)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_BASELINE], check=True, capture_output=True, text=True).stdout
    baseline = vmrss(out)
    if baseline is None:
        raise RuntimeError("no VmRSS in the interpreter's /proc status")
    return baseline


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as loaded (each storage once), before a runner packs or frees any."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen and tensor.numel():
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def describe(speeds: list[StepSpeed]) -> list[str]:
    lines = []
    for s in speeds:
        faster = "row by row" if s.row_by_row_ms < s.gathered_ms else "gathered"
        lines.append(f"decode step, {s.rows:2d} rows x {s.context} positions: row by row {s.row_by_row_ms:6.1f} ms, "
                     f"gathered {s.gathered_ms:6.1f} ms (faster: {faster}; the runner takes {s.runner_takes})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run apart from other benches (`python -m services.bench.kv_step_speed`), so that the resident set is a
    verifier's: this model, its runner and its default pool, in a fresh process."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--hardware", action="store_true", help="print the hardware first (run on its own)")
    args = parser.parse_args(argv)
    if args.hardware:
        print(json.dumps(describe_hardware()))
    loaded = load_model(args.model, device="cpu", dtype="float32")
    weights = weight_bytes(loaded.model)
    runner = create_runner(loaded.model, max(ROWS), max(CONTEXTS) + 8, owns_model=True)  # as a verifier: one copy
    pool = runner.cache.keys.nbytes + runner.cache.values.nbytes
    trim_heap("runner built")  # as a verifier does once it serves (heap_trim.py)
    resident, baseline = resident_bytes(), import_baseline_bytes()
    gib = 2**30
    print(f"verifier memory ({args.model}): resident {resident / gib:.2f} GiB = pool {pool / gib:.2f} GiB + "
          f"{(resident - pool) / gib:.2f} GiB, against {weights / gib:.2f} GiB of weights: "
          f"{(resident - pool) / weights:.2f}x the weights beside the pool; an interpreter importing what a "
          f"verifier imports holds {baseline / gib:.2f} GiB, without which "
          f"{(resident - pool - baseline) / weights:.2f}x")
    for line in describe(step_speeds(runner)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
