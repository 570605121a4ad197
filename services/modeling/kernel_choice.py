"""Choose the faster CPU linear kernel per weight shape and number of token rows, by measuring at start-up.

Why: which kernel wins depends on the machine, the weight's shape and M (token rows in the matmul), and no
rule of thumb got it right. On a 2-core AMD EPYC (avx512) oneDNN's pre-reordered weights (cpu_linear.py) beat
F.linear at every SmolLM2 shape and M; on an Intel Xeon with AMX a user measured F.linear faster at M=1 for
[576x576], [1536x576] and [576x1536] (12 vs 20, 35 vs 50, 31 vs 56 us) while at M=9 the [49152x576] LM head
was 3.4 ms packed against 8.0 ms plain. So the engine times both on the model's own shapes and dtype at
start-up and keeps, per M bucket, whichever was faster.

What is timed has to look like the forward. Calling one weight again and again times it hot in cache, which
the forward never sees (each layer's weights are evicted by the other layers' before the next step): on the
EPYC, [576x576] at M=1 is 21 us plain vs 22 us packed hot, but 84 vs 47 us when the 30 layers' weights are
visited in turn, and a runner that followed the hot numbers (plain o_proj and down_proj at M=1) took 25 ms
per one-token forward against 21 ms all packed. So every call of the measurement goes to the next layer's
weight of that shape (plain and packed copies alike), as the forward does.

How, kept cheap (start-up must stay fast):
- each distinct weight shape is measured once per model (KernelChooser) and the decision shared by every
  layer with that shape: SmolLM2's 30 layers plus head have 5 shapes;
- M is measured at a few points (DEFAULT_ROWS); a call with M rows uses the decision of the smallest measured
  M >= it, and the largest measured M's decision above that;
- the points are measured in order of how much they matter (M=1 decode, M=8 about K+1 verification, then
  the rest ascending) under a per-shape time budget, so a large weight (the LM head) that runs out of budget
  still has its decode and verify sizes measured;
- candidates are interleaved (order rotated each round) after one warm-up call each (oneDNN builds its
  primitive for a new shape on the first call), and the fastest repetition of each decides: other work on a
  shared machine only ever adds time, so the minimum is the estimate it disturbs least (with the median, a
  `specserve serve` started beside a busy test run picked F.linear at M=1 for q/k/v, which is 2x slower here).

The timer is a parameter (`measure`), so tests can feed fake timings and check the dispatch without timing.
"""

from __future__ import annotations

import bisect
import itertools
import math
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from services.modeling.cpu_linear import LinearFn, packed_linear

logger = logging.getLogger(__name__)

# Token-row counts measured, in order of importance (see module docstring); buckets use them sorted.
DEFAULT_ROWS: tuple[int, ...] = (1, 8, 2, 4, 16, 32, 64)
# Seconds of kernel calls one shape may spend being measured; once spent, no further M point is started.
DEFAULT_BUDGET_S = 0.1
# A candidate after the first (plain: no extra memory) must be this much faster to be chosen, so that a tie
# within timing noise neither flips the choice from bucket to bucket nor keeps a packed copy for nothing.
DEFAULT_MARGIN = 0.05

# measure(name, kernel, x) -> seconds one call of kernel(x) took; name is the candidate's, for fake timers.
Measure = Callable[[str, LinearFn, torch.Tensor], float]


def time_call(name: str, kernel: LinearFn, x: torch.Tensor) -> float:
    """Wall time of one call (CPU ops are synchronous, so no device sync is needed)."""
    start = time.perf_counter()
    kernel(x)
    return time.perf_counter() - start


@dataclass(frozen=True)
class KernelChoice:
    """The measured decision for one weight shape: which candidate to run at each measured M."""

    names: tuple[str, ...]  # candidates in the order given; near-ties go to the first
    rows: tuple[int, ...]  # measured M values, ascending
    chosen: tuple[str, ...]  # per entry of rows
    # per entry of rows: the fastest seconds of each candidate (in names order)
    seconds: tuple[tuple[float, ...], ...]

    def kernel_at(self, m: int) -> str:
        """The candidate for a call with m token rows: that of the smallest measured M >= m, else the largest."""
        return self.chosen[min(bisect.bisect_left(self.rows, m), len(self.rows) - 1)]

    def uses(self, name: str) -> bool:
        return name in self.chosen

    def one_kernel(self) -> KernelChoice:
        """The same decision with one kernel at every M, so that one layout of the weights is kept: the candidate
        whose time relative to the first's has the lowest geometric mean over the measured M (ties: the first).

        Each M counts alike, relatively: summed seconds let the largest M (the slowest calls, rare in decode)
        decide, and on a noisy machine that flipped SmolLM2's down_proj to plain from one start to the next
        while packed was faster at most M (16 one-token rows: 10 ms more a step). No margin favours the first
        candidate here: either way one copy of the weights is kept."""
        logs = [sum(math.log(per_m[i] / per_m[0]) for per_m in self.seconds if per_m[0] > 0 and per_m[i] > 0)
                for i in range(len(self.names))]
        name = self.names[min(range(len(logs)), key=lambda i: (logs[i], i))]
        return KernelChoice(self.names, self.rows, (name,) * len(self.rows), self.seconds)

    def describe(self) -> str:
        """e.g. 'plain at M=1, packed at M>=2' or 'packed at all M'."""
        groups: list[tuple[int, int, str]] = []  # (first M, last measured M, kernel)
        low = 1
        for m, name in zip(self.rows, self.chosen, strict=True):
            if groups and groups[-1][2] == name:
                groups[-1] = (groups[-1][0], m, name)
            else:
                groups.append((low, m, name))
            low = m + 1
        if len(groups) == 1:
            return f"{groups[0][2]} at all M"
        parts = []
        for index, (first, last, name) in enumerate(groups):
            if index == len(groups) - 1:
                span = f"M>={first}"
            else:
                span = f"M={first}" if first == last else f"M={first}..{last}"
            parts.append(f"{name} at {span}")
        return ", ".join(parts)


def measure_choice(
    instances: Sequence[Mapping[str, LinearFn]],
    in_features: int,
    dtype: torch.dtype,
    *,
    rows: Sequence[int] = DEFAULT_ROWS,
    measure: Measure = time_call,
    repeats: int = 5,
    min_repeats: int = 3,
    budget_s: float = DEFAULT_BUDGET_S,
    margin: float = DEFAULT_MARGIN,
) -> KernelChoice:
    """Time the candidates on random [M, in_features] inputs at each M of `rows` (in that order) and keep
    the fastest per M, except that the first candidate is kept unless another is faster by more than
    `margin` (a fraction).

    instances: the candidates (name -> kernel, same names in each) of every weight with this shape, e.g. one
    per layer in layer order; each round goes to the next one, so a weight is timed out of cache as in the
    forward. The budget counts the measured seconds (warm-up included); past it, the current M stops after
    min_repeats rounds and no further M is started (at least one M is always measured)."""
    if not instances or not instances[0]:
        raise ValueError("measure_choice needs at least one candidate")
    names = tuple(instances[0])
    if len(names) == 1:
        return KernelChoice(names, (1,), names, ((0.0,),))
    turn = itertools.cycle(instances)
    generator = torch.Generator().manual_seed(0)
    fastest: dict[int, tuple[float, ...]] = {}
    spent = 0.0
    with torch.inference_mode():
        for m in rows:
            if fastest and spent >= budget_s:
                break
            x = torch.randn(m, in_features, generator=generator).to(dtype)
            candidates = next(turn)
            for name in names:  # warm-up, not kept
                spent += measure(name, candidates[name], x)
            samples: dict[str, list[float]] = {name: [] for name in names}
            for round_ in range(repeats):
                if round_ >= min_repeats and spent >= budget_s:
                    break
                candidates = next(turn)
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    seconds = measure(name, candidates[name], x)
                    samples[name].append(seconds)
                    spent += seconds
            fastest[m] = tuple(min(samples[name]) for name in names)
    measured = tuple(sorted(fastest))
    chosen = tuple(names[pick_fastest(fastest[m], margin)] for m in measured)
    return KernelChoice(names, measured, chosen, tuple(fastest[m] for m in measured))


def pick_fastest(seconds: tuple[float, ...], margin: float) -> int:
    """The index of the fastest, except that the first is kept unless another is faster by more than `margin`."""
    fastest = min(range(len(seconds)), key=seconds.__getitem__)
    return 0 if seconds[0] <= seconds[fastest] * (1.0 + margin) else fastest


class DispatchLinear:
    """A linear that runs, for each call, the kernel its KernelChoice picked for that call's number of token
    rows (x.numel() // in_features). It holds only the kernels the choice uses, so a packed copy that never
    won is freed."""

    def __init__(self, kernels: Mapping[str, LinearFn], choice: KernelChoice, in_features: int) -> None:
        self.choice = choice
        self.in_features = in_features
        top = choice.rows[-1]
        self._by_rows = [kernels[choice.kernel_at(m)] for m in range(top + 1)]  # list index = M
        self._above = kernels[choice.kernel_at(top + 1)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // self.in_features
        return (self._by_rows[m] if m < len(self._by_rows) else self._above)(x)


def plain_linear(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> LinearFn:
    """F.linear over the modules' own weights (detached views, no copy). For several weights (fused q/k/v,
    gate/up) it runs one F.linear per weight and concatenates the outputs, rather than keeping a concatenated
    copy of the weights: that copy would be a third one next to the modules' and the packed weights (up to
    about half of a small model's parameters), and on a 2-core EPYC the separate calls cost the same as one
    call on the concatenation (SmolLM2, weights out of cache as in the forward, M=1: q/k/v 156 vs 146 us,
    gate/up 469 vs 470 us; M=8: 260 vs 247, 714 vs 720 us). The measurement times this
    very callable, so the cost of the concatenation is part of the choice."""
    pairs = [(w.detach(), None if b is None else b.detach()) for w, b in zip(weights, biases, strict=True)]
    if len(pairs) == 1:
        weight, bias = pairs[0]
        return lambda x: torch.nn.functional.linear(x, weight, bias)

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.nn.functional.linear(x, w, b) for w, b in pairs], dim=-1)

    return linear


# (out sizes, in features, dtype, device type, has bias)
ShapeKey = tuple[tuple[int, ...], int, torch.dtype, str, bool]
# (role, weights, biases): one linear over the concatenated weights ([sum out, in]); role names it in logs
Site = tuple[str, Sequence[torch.Tensor], Sequence[torch.Tensor | None]]
# chosen(site indices, their linears): one shape's sites are done (KernelChooser.choose)
ChosenCallback = Callable[[list[int], list[DispatchLinear | None]], None]


def candidate_kernels(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                      allow_bf16: bool = False) -> dict[str, LinearFn] | None:
    """A site's kernels by name ("plain", "packed", and with allow_bf16 "bf16" for float32 weights), or None where
    packing is unavailable."""
    packed = packed_linear(weights, biases)
    if packed is None:
        return None
    candidates = {"plain": plain_linear(weights, biases), "packed": packed}
    if allow_bf16 and weights[0].dtype == torch.float32:
        rounded = packed_linear(weights, biases, torch.bfloat16)
        if rounded is not None:
            candidates["bf16"] = rounded
    return candidates


def _shape_key(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> ShapeKey:
    return (tuple(int(w.shape[0]) for w in weights), int(weights[0].shape[1]), weights[0].dtype,
            weights[0].device.type, biases[0] is not None)


class KernelChooser:
    """Builds the dispatching linears of one model, measuring each distinct shape once over all the weights
    with that shape and sharing the decision between them. Candidates: "plain" (plain_linear) and "packed"
    (cpu_linear.packed_linear), and with allow_bf16 "bf16" (a packed bfloat16 copy of float32 weights). Where
    packing is unavailable (non-CPU device, unsupported dtype, probe failed) a site gets None and is not
    measured, so the caller keeps its plain modules."""

    def __init__(
        self,
        measure: Measure = time_call,
        rows: Sequence[int] = DEFAULT_ROWS,
        budget_s: float = DEFAULT_BUDGET_S,
        one_layout: bool = False,
        allow_bf16: bool = False,
    ) -> None:
        """one_layout: one kernel per shape at every M (KernelChoice.one_kernel), so that a process that owns its
        model keeps one copy of each weight (the runner frees the plain one where packed is chosen).
        allow_bf16: float32 weights may also run as a packed bfloat16 copy, chosen where measured faster. It
        changes the products (inputs and weights rounded to bfloat16), so only drafters allow it: what they
        compute decides which tokens are proposed, and the verifier's rejection sampling keeps the output
        exactly the target's whatever they propose. A verifier never does."""
        self.one_layout = one_layout
        self.allow_bf16 = allow_bf16
        self._measure = measure
        self._rows = tuple(rows)
        self._budget_s = budget_s
        self._choices: dict[ShapeKey, KernelChoice] = {}
        self._roles: dict[ShapeKey, list[str]] = {}
        self.measure_seconds = 0.0  # wall time spent measuring, for start-up logs

    @property
    def choices(self) -> dict[ShapeKey, KernelChoice]:
        return dict(self._choices)

    def choose(self, sites: Sequence[Site], chosen: ChosenCallback | None = None) -> list[DispatchLinear | None]:
        """One dispatching linear per site (None where packing is unavailable). Give all of a model's sites
        in forward order in one call: a shape is timed over all its sites.

        Shapes are taken one at a time: a shape's sites are packed, timed and given their DispatchLinear, which
        keeps only the kernels it runs, and then `chosen(site indices, their linears)` is called before the next
        shape is packed, so that a caller that owns the model can free the weights that no longer run
        (LlamaFamilyRunner). The start-up peak then holds one shape's extra copies beside the model, not every
        shape's (packing everything first held the model's weights about twice, 2.5 times with a drafter's
        bfloat16 copies)."""
        linears: list[DispatchLinear | None] = [None] * len(sites)
        by_shape: dict[ShapeKey, list[int]] = {}
        for index, (_, weights, biases) in enumerate(sites):
            by_shape.setdefault(_shape_key(weights, biases), []).append(index)
        for key, indices in by_shape.items():
            candidates = {i: candidate_kernels(*sites[i][1:], allow_bf16=self.allow_bf16) for i in indices}
            packable = [i for i in indices if candidates[i] is not None]
            if packable:
                roles = self._roles.setdefault(key, [])
                roles.extend(role for role in dict.fromkeys(sites[i][0] for i in packable) if role not in roles)
            if packable and key not in self._choices:
                start = time.perf_counter()
                choice = measure_choice([candidates[i] for i in packable], key[1], key[2], rows=self._rows,
                                        measure=self._measure, budget_s=self._budget_s)
                self.measure_seconds += time.perf_counter() - start
                self._choices[key] = choice.one_kernel() if self.one_layout else choice
                logger.debug("linear kernels for %s: %s %s", _shape(key), choice.describe(), choice.seconds)
            for i in packable:
                linears[i] = DispatchLinear(candidates[i], self._choices[key], key[1])
            del candidates  # the kernels no DispatchLinear runs go now, before the next shape is packed
            if chosen is not None:
                chosen(indices, [linears[i] for i in indices])
        return linears

    def linear(
        self, role: str, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
    ) -> DispatchLinear | None:
        """One site on its own (timed on that weight alone, so hot in cache: for tests and single weights)."""
        return self.choose([(role, weights, biases)])[0]

    def describe(self) -> str:
        """One line per model, e.g. 'q/k/v [960x576] packed at all M; o_proj [576x576] plain at M=1, packed
        at M>=2; ...'."""
        return "; ".join(
            f"{','.join(self._roles[key])} {_shape(key)} {choice.describe()}"
            for key, choice in self._choices.items()
        )


def _shape(key: ShapeKey) -> str:
    return f"[{sum(key[0])}x{key[1]}]"
