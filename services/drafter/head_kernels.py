"""The EAGLE head's matmuls on CPU through the kernels measured fastest there: plain F.linear, oneDNN's packed
weights (services/modeling/cpu_linear.py, as the target's runner uses), or a packed bfloat16 copy of them.

Why: a draft step of the shipped SmolLM2 head on one row is a handful of small matmuls and the product with its
8,192 LM head rows, and on CPU these ran as plain products: `outputs @ rows.T` took 1,228 us at one row and 2,002
at eight, where oneDNN's packed weights take 189 and 443 (2-core EPYC, float32, warm cache), so a chain of 4 cost
about 16 ms an ask next to a 50 ms target step. At a few rows these products are bound by the bytes of weights
they read, and a bfloat16 copy reads half: the head's linears and rows took 0.46 ms a step at one row against
1.32 packed in float32 and 3.10 plain, 0.91 against 2.11 and 4.31 at eight (weights visited in turn, out of
cache). bfloat16 rounds the inputs and weights of each product (accumulated in float32), which only a drafter may
do: its numerics decide which drafts it proposes, and the verifier's output never depends on them (measured: no
acceptance lost, docs/eagle.md). On an accelerator the chain is one captured graph of the plain products
(eagle_head_graphs.py), so this is for CPU drafters only.

How the choice is made: the target's runner times each weight shape on its own, rotating through the layers that
share it so that each call meets its weight out of cache as the forward does (kernel_choice.py). A head is one
layer, one weight per shape, so timed that way every call ran hot in cache and the choice flipped from one start
to the next between plain, packed and bfloat16 for the same shape. So the head is timed whole instead: one draft
step (the head's layer and the rows' product) at 1, 8 and 32 rows with every matmul on one candidate, after
evicting the caches as the verifier's forward does between two asks, fastest of a few rounds; each row count takes
the candidate that won there (the first, plain, unless another is faster by more than kernel_choice's margin).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from services.modeling.cpu_linear import LinearFn
from services.modeling.eagle_head import DraftRows
from services.modeling.kernel_choice import (DEFAULT_MARGIN, DispatchLinear, KernelChoice, candidate_kernels,
                                             pick_fastest, plain_linear)

logger = logging.getLogger(__name__)

STEP_ROWS = (1, 8, 32)  # a draft step's rows: one sequence's chain, eight sequences', a tree level of a few
CACHED_POSITIONS = 256  # the committed head positions a timed step attends to
ROUNDS = 5  # timed rounds per candidate and row count, after one warm-up each
EVICT_BYTES = 64 * 2**20  # written between two timed steps: more than a server CPU's last-level cache, mostly

# measure(candidate, rows, step) -> seconds one call of step() took; tests pass fake timers
StepTimer = Callable[[str, int, Callable[[], object]], float]


class ChosenLinear(nn.Module):
    """A linear module that runs the kernel chosen for its weight. It keeps the weight too, for code that reads a
    layer's dtype and device from it (eagle_trees.padded_caches)."""

    def __init__(self, kernel: LinearFn, weight: nn.Parameter) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = weight

    def forward(self, x):
        return self.kernel(x)


def evicting_timer(evict_bytes: int = EVICT_BYTES) -> StepTimer:
    """A timer that writes `evict_bytes` before each timed call, so the step reads its weights from memory."""
    scratch = torch.empty(evict_bytes // 4, dtype=torch.float32)

    def measure(candidate: str, rows: int, step: Callable[[], object]) -> float:
        scratch.fill_(float(rows))
        started = time.perf_counter()
        step()
        return time.perf_counter() - started

    return measure


def use_chosen_kernels(head: nn.Module, rows: DraftRows, measure: StepTimer | None = None) -> DraftRows:
    """Replace the head's linear layers by the kernels a whole draft step measured fastest (module docstring) and
    return the draft rows applied through theirs. Where packing is unavailable (not a CPU tensor, a dtype oneDNN
    lacks) everything stays as it was. An EAGLE-3 head's own LM head is applied through the rows, not as a module,
    so it is one of the rows' candidates."""
    linears = [(name, module) for name, module in head.named_modules()
               if isinstance(module, nn.Linear) and module.weight is not rows.weight]
    sites = [([module.weight], [module.bias]) for _, module in linears] + [([rows.weight], [None])]
    candidates = [candidate_kernels(weights, biases, allow_bf16=True) or {"plain": plain_linear(weights, biases)}
                  for weights, biases in sites]
    names = tuple(name for name in ("plain", "packed", "bf16") if all(name in c for c in candidates))
    if names == ("plain",):
        return rows
    installed = [ChosenLinear(kernels["plain"], module.weight)
                 for (_, module), kernels in zip(linears, candidates[:-1], strict=True)]
    for (name, _), module in zip(linears, installed, strict=True):
        _replace(head, name, module)
    started = time.perf_counter()
    choice = _measure(head, rows, installed, candidates, names, measure or evicting_timer())
    for module, kernels in zip(installed, candidates[:-1], strict=True):
        module.kernel = DispatchLinear(kernels, choice, module.weight.shape[1])
    logger.info("EAGLE head kernels (a draft step timed whole in %.2f s): %s; ms a step by rows: %s",
                time.perf_counter() - started, choice.describe(), _seconds(choice))
    return DraftRows(rows.weight, DispatchLinear(candidates[-1], choice, rows.weight.shape[1]))


def _replace(head: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(head.get_submodule(parent) if parent else head, attribute, module)


@torch.inference_mode()
def _measure(head, rows: DraftRows, installed: list[ChosenLinear], candidates: list[dict[str, LinearFn]],
             names: tuple[str, ...], measure: StepTimer) -> KernelChoice:
    """Time one draft step per candidate (every matmul on it) at each of STEP_ROWS; candidates interleaved, their
    order rotated each round, the fastest round of each kept (other work only ever adds time)."""
    config, weight = head.config, rows.weight
    generator = torch.Generator().manual_seed(0)
    fastest = []
    for m in STEP_ROWS:
        inputs = [torch.randn(m, 1, config.hidden_size, generator=generator).to(weight.dtype) for _ in range(2)]
        keys = torch.randn(m, config.num_key_value_heads, CACHED_POSITIONS, config.head_dim,
                           generator=generator).to(weight.dtype)
        cache, mask = (keys, keys.clone()), torch.ones(m, CACHED_POSITIONS, dtype=torch.bool)
        positions = torch.full((m,), CACHED_POSITIONS)

        def step() -> object:
            out, _, _ = head.step_rows(*inputs, positions, cache, mask)
            return head.draft_scores(out[:, -1], DraftRows(weight, rows_kernel))  # the timed candidate's

        samples = {name: [] for name in names}
        for round_ in range(ROUNDS + 1):  # round 0 warms up: oneDNN builds its primitive on a shape's first call
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                for module, kernels in zip(installed, candidates[:-1], strict=True):
                    module.kernel = kernels[name]
                rows_kernel = candidates[-1][name]
                seconds = measure(name, m, step)
                if round_:
                    samples[name].append(seconds)
        fastest.append(tuple(min(samples[name]) for name in names))
    chosen = tuple(names[pick_fastest(seconds, DEFAULT_MARGIN)] for seconds in fastest)
    return KernelChoice(names, STEP_ROWS, chosen, tuple(fastest))


def _seconds(choice: KernelChoice) -> str:
    return "; ".join(f"{m}: " + ", ".join(f"{name} {s * 1e3:.2f}" for name, s in zip(choice.names, seconds))
                     for m, seconds in zip(choice.rows, choice.seconds, strict=True))
