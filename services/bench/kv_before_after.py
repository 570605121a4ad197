"""Step speed of this checkout against the slot cache it replaced: before/after rows for the paged KV
cache, measured side by side in one run (part of `make bench-prefix`).

The revision before the paged KV cache (BEFORE) is checked out into a temporary git worktree, and the same probe
(PROBE: build the model's runner as a verifier does, fill ROWS sequences with CONTEXT tokens each, then time
forwards of one token a row, a decode step, and of five, a verify step at K = 4) runs in a fresh process in each
checkout, alternating for a number of rounds so that the machine's drift falls on both. Each process is a
different start, so each round also re-measures the start-up kernel choice. Prints the median step time of
each side and their ratio (before / after: above 1 is faster now).

    python -m services.bench.kv_before_after [--model smollm2-135m-instruct] [--rounds 6] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from services.bench.hardware import describe_hardware

BEFORE = "3fc3291^"  # the parent of the commit that brought the paged KV cache: the per-sequence slot cache
CONTEXT = 150  # cached positions per row: a short chat's
SHAPES = ((1, 1), (8, 1), (16, 1), (8, 5), (16, 5))  # (rows, tokens fed per row)

# Run with the checkout as the working directory, so that `services` is imported from it; only calls whose
# signatures both sides share (owns_model exists after the paged cache only: the one-copy rule).
PROBE = """
import inspect, json, statistics, sys, time
from services.modeling.loading import load_model
from services.modeling.runner import RowInput
from services.modeling.runner_factory import create_runner
model, context, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
loaded = load_model(model, device="cpu", dtype="float32")
extra = {"owns_model": True} if "owns_model" in inspect.signature(create_runner).parameters else {}
rows_max = max(rows for rows, _ in shapes)
runner = create_runner(loaded.model, rows_max, context + 16, **extra)
result = {}
for rows, fed in shapes:
    ids = [f"r{rows}-{fed}-{i}" for i in range(rows)]
    for i, seq in enumerate(ids):
        runner.add_sequence(seq)
        runner.forward([RowInput(seq, [(7 * j + 13 * i) % 1000 + 5 for j in range(context)], 1)])
    seconds = []
    for step in range(12):
        started = time.perf_counter()
        runner.forward([RowInput(seq, [11] * fed, fed) for seq in ids])
        if step >= 2:
            seconds.append(time.perf_counter() - started)
        for seq in ids:
            runner.truncate(seq, context)
    for seq in ids:
        runner.remove_sequence(seq)
    result[f"{rows}x{fed}"] = statistics.median(seconds) * 1e3
print("PROBE " + json.dumps(result))
"""


def probe(checkout: Path, model: str) -> dict[str, float]:
    """Median ms per step for each shape, measured by a fresh interpreter importing `checkout`'s code."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, model, str(CONTEXT), json.dumps(SHAPES)],
        cwd=checkout, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[len("PROBE "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--before", default=BEFORE, help="the revision to compare against (default: the slot cache)")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[2]
    print(json.dumps(describe_hardware()))
    with tempfile.TemporaryDirectory(prefix="specserve-before-") as scratch:
        before = Path(scratch) / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(before), args.before], cwd=repo, check=True)
        try:
            sides: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for round_ in range(args.rounds):
                order = [("before", before), ("after", repo)][:: 1 if round_ % 2 == 0 else -1]
                for name, checkout in order:
                    sides[name].append(probe(checkout, args.model))
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=repo, check=False)
    print(f"step speed, {args.model}, {CONTEXT} cached positions a row, medians of {args.rounds} alternating "
          f"processes per side (before: {args.before}{', the slot cache' if args.before == BEFORE else ''})")
    print("| rows x tokens fed | before ms | after ms | speed after / before |")
    print("|---|---:|---:|---:|")
    for rows, fed in SHAPES:
        key = f"{rows}x{fed}"
        old = statistics.median(run[key] for run in sides["before"])
        new = statistics.median(run[key] for run in sides["after"])
        print(f"| {rows} x {fed} | {old:.1f} | {new:.1f} | {old / new:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
