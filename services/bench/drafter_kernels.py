"""`python -m services.bench.drafter_kernels`: what a CPU drafter's kernel choice buys, side by side in one run.

Rows: an EAGLE ask of the shipped heads (a chain of K, and an EAGLE-3 tree) at 1 and 8 sequences, and, with
--draft-model, that model's one-token forward at 1 and 8 rows; each with the kernels chosen at start-up
(services/drafter/head_kernels.py, kernel_choice.py: bfloat16 copies allowed, as a drafter runs) against every
matmul on oneDNN's packed float32 weights (what drafters ran before the bfloat16 copies). The caches are evicted
before each timed call, as the verifier's forward evicts them between two asks on a CPU it shares; asks are
steady-state (300 committed tokens, then 2 more a call); the fastest of --repeats calls a row, the two sides
alternating call by call so that the machine's noise falls on both.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Sequence

import torch

from services.bench import available_cores
from services.bench.hardware import describe_hardware
from services.common.proposer import DraftInput
from services.common.speculative_config import SpeculativeConfig
from services.drafter.head_kernels import evicting_timer, use_chosen_kernels
from services.drafter.methods.eagle import EagleProposer, load_proposer

CONTEXT = 300  # committed tokens a sequence has when asks start
NEW_PER_ASK = 2  # tokens committed between two asks


def packed_float32(name: str, rows: int, step: Callable[[], object]) -> float:
    """A draft-step timer under which oneDNN's packed float32 kernels win: the baseline side."""
    step()
    return 0.0 if name == "packed" else 1.0


def eagle_side(config: dict, chosen: bool) -> EagleProposer:
    proposer = load_proposer(SpeculativeConfig.model_validate(config))
    rows = proposer._draft_rows()
    proposer.draft_rows = use_chosen_kernels(proposer.head, rows, None if chosen else packed_float32)
    return proposer


class Asks:
    """Steady-state asks of `sequences` random sequences (random states: what is timed is the work, not the
    drafts)."""

    def __init__(self, proposer: EagleProposer, sequences: int, k: int, seed: int = 0) -> None:
        self.proposer, self.k = proposer, k
        self.generator = torch.Generator().manual_seed(seed)
        self.tokens = {f"s{i}": torch.randint(0, 8000, (CONTEXT,), generator=self.generator).tolist()
                       for i in range(sequences)}
        self.states = {s: torch.randn(CONTEXT, proposer.state_width, generator=self.generator) for s in self.tokens}

    def __call__(self) -> None:
        inputs = [DraftInput(s, tokens, self.k, self.states[s][: len(tokens) - 1]) for s, tokens in self.tokens.items()]
        self.proposer._draft_all(inputs)
        for s in self.tokens:
            self.tokens[s] += torch.randint(0, 8000, (NEW_PER_ASK,), generator=self.generator).tolist()
            self.states[s] = torch.cat([self.states[s], torch.randn(NEW_PER_ASK, self.proposer.state_width,
                                                                    generator=self.generator)])


def fastest_alternating(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """The fastest of `repeats` timed calls of each, interleaved, each after evicting the caches (the timer the
    EAGLE head's kernel choice uses)."""
    measure = evicting_timer()
    best = [float("inf")] * len(calls)
    for round_ in range(repeats + 1):
        for i, call in enumerate(calls):
            seconds = measure(str(i), 0, call)
            if round_:  # round 0 warms up
                best[i] = min(best[i], seconds)
    return best


def eagle_rows(args) -> list[tuple[str, float, float]]:
    out = []
    chain = {"method": "eagle", "num_speculative_tokens": args.k}
    tree = {"method": "eagle3", "num_speculative_tokens": 4, "num_draft_tokens": 24, "eagle_topk": 8}
    for label, config, k in ((f"EAGLE-1 chain of {args.k}", chain, args.k),
                             ("EAGLE-3 tree of 24 (top-8, depth 4)", tree, 24)):
        sides = [eagle_side(config, chosen=False), eagle_side(config, chosen=True)]
        for sequences in args.sequences:
            before, after = fastest_alternating([Asks(p, sequences, k) for p in sides], args.repeats)
            out.append((f"{label}, ask of {sequences} sequence(s)", before, after))
    return out


def draft_model_rows(args) -> list[tuple[str, float, float]]:
    from services.modeling.loading import load_model
    from services.modeling.runner import RowInput
    from services.modeling.runner_factory import create_runner

    runners = []
    for allow_bf16 in (False, True):  # each owns its model, which frees the weights it no longer runs
        loaded = load_model(args.draft_model, device="cpu", dtype="float32")
        # the prompt, then one token a timed call (warm-up included)
        runners.append(create_runner(loaded.model, max(args.sequences), CONTEXT + args.repeats + 1,
                                     owns_model=True, allow_bf16=allow_bf16))
        loaded = None
        gc.collect()
    out = []
    generator = torch.Generator().manual_seed(0)
    vocab = runners[0].vocab_size
    for rows in args.sequences:
        names = [f"r{rows}-{i}" for i in range(rows)]
        prompt = torch.randint(0, vocab, (CONTEXT,), generator=generator).tolist()
        with torch.inference_mode():
            for runner in runners:
                for name in names:
                    runner.add_sequence(name)
                runner.forward([RowInput(name, prompt, 1) for name in names])

            def step(runner) -> Callable[[], object]:
                return lambda: runner.forward([RowInput(name, [int(prompt[0])], 1) for name in names])

            before, after = fastest_alternating([step(r) for r in runners], args.repeats)
        for runner in runners:
            for name in names:
                runner.remove_sequence(name)
        out.append((f"{args.draft_model} one-token forward, {rows} row(s)", before, after))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.drafter_kernels",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="the EAGLE-1 chain's length")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--draft-model", default=None,
                        help="also a draft model's forward, e.g. qwen2.5-coder-0.5b-instruct (fetched once)")
    args = parser.parse_args(argv)
    torch.set_num_threads(available_cores())
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    rows = eagle_rows(args) + (draft_model_rows(args) if args.draft_model else [])
    print("\n| drafting work (caches evicted before each) | packed float32, ms | chosen kernels, ms | ratio |")
    print("|---|---:|---:|---:|")
    for label, before, after in rows:
        print(f"| {label} | {before * 1e3:.1f} | {after * 1e3:.1f} | {before / after:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
