"""Captured forwards: on an accelerator, a decode or verify forward replays a graph instead of launching its kernels.

A small model's step on a GPU is launch-bound: SmolLM2-135M's eager forward launches about 1,500 kernels and keeps
the H100 busy 3.1 ms of 38.8 (issue 29). A graph captured once per batch shape and replayed launches them as one.
The shape is (rows, width, span): rows are padded up to the next capture size (vLLM's `cudagraph_capture_sizes`),
the width (the step's tokens a row: 1 to decode, K + 1 to verify) up to the next of WIDTH_BUCKETS, and the span
(key positions a row reads) up to a power of two from a floor, so a sequence crosses a handful of spans in its
whole life. The floor is MIN_SPAN for a full batch and higher for a small one (span_floor: rows x width x span
about GATHER_POSITIONS), so that a small batch's graph serves its sequences a while: one row of one token over 1,024
positions replayed in 1.87 ms on an H100, 3% more than over 256. The floor was 4,096 positions for one row of any
width (one graph for a sequence's whole life) until the H100 measured what that cost: a row of 2-9 tokens replayed
in 4.3 ms over 4,096 positions against 2.4 over 512 (attention, whose work is rows x width x span), so a verify
step at one request cost 1.9x a decode step where over its own span it costs 1.3x, and a decode step 2.25 ms, 23%
more than over 512. Longer spans are captured the first time a step reaches them (about 0.07 s each, once).
The forward reads its inputs from one static buffer (forward_batch.py packs them), so a replay costs one
host-to-device copy and one launch. The engine captures the
shapes of short sequences before its first step (shapes_to_capture: every capture size, every width bucket up to
its widest verify, the size's span floor); any other shape is captured the first time a step has it (the capture
runs the forward it captures, so nothing is computed twice). A graph may carry a tail (GraphTail): work on the
forward's logits, the verification of a plain decode step, keyed beside the shape. Prefill chunks are captured
too, as vLLM's piecewise graphs take any token count up to 512: an eager chunk cost an H100 as long as an eager
decode step (45 ms), ten times a captured one, however few its tokens. Chunks wider than max_width, rows beyond
the largest size and CPU forwards run eagerly as before.

Why capture ahead and bucket widths: on an H100, capturing shapes as steps first met them made speculation slower
than none (ngram at 8 concurrent chats: 0.43x), because adaptive speculation varies K, and so the width, from step
to step, and every new (rows, width, span) stalled the batch for a capture (0.1 s each). Padding a verify to 1 + a
power of two drafts costs next to nothing in a launch-bound step (the default K = 4 verifies 5 positions exactly).

The graph API is CUDA's (torch.cuda.CUDAGraph); Ascend's torch_npu mirrors it as torch.npu.NPUGraph (vLLM Ascend's
ACL graphs), which TorchGraphs takes the same way: not tried here, no NPU was at hand. Tests on CPU put a backend
behind the same GraphBackend protocol that replays by running the forward again, so the padding, the static
inputs and the shape buckets are checked without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.modeling.forward_batch import ForwardBatch
from services.modeling.host_copies import pinned

logger = logging.getLogger(__name__)

MIN_SPAN = 256  # the smallest span a graph reads; spans above round up to a power of two
GATHER_POSITIONS = 1024  # a graph of r rows of w tokens reads at least this / (r x w) positions a row (span_floor)
MAX_WIDTH = 512  # the widest row a graph takes (a prefill chunk of the default --max-num-batched-tokens)
# A row's width is padded up to one of these: a verify's to 1 + 2^k drafts, a prefill chunk's to a power of two
WIDTH_BUCKETS = (1, 2, 3, 5, 9, 17, 33, 64, 128, 256, MAX_WIDTH)


def width_bucket(width: int) -> int | None:
    """The width of the graph that takes rows of `width` tokens; None: wider than any graph."""
    return next((bucket for bucket in WIDTH_BUCKETS if bucket >= width), None)


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default shape: 1, 2, 4, then every multiple of 8, up to the scheduling limit."""
    sizes = [n for n in (1, 2, 4) if n <= max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return tuple(sorted({min(n, max_num_seqs) for n in sizes}))


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): how graph shapes round up."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class GraphSettings:
    """enforce_eager: never capture (vLLM's --enforce-eager). capture_sizes: the row counts a graph is captured for
    (None: default_capture_sizes of max_num_seqs)."""

    enforce_eager: bool = False
    capture_sizes: tuple[int, ...] | None = None


Outputs = tuple[torch.Tensor, ...]  # a forward's (hidden [B, L, H], served states [B, L, layers * H]), then a tail's
Body = Callable[[ForwardBatch], Outputs]
Head = Callable[[ForwardBatch, torch.Tensor], torch.Tensor]  # (batch, hidden) -> logits [B, L, V] of its selected


class GraphTail(Protocol):
    """Work a step does after its forward, on the forward's logits, captured in the same graph: the verification of
    a plain decode step (services/verifier/captured_verify.py). Launched eagerly after the graph it was about 20
    kernels and host-to-device copies a step (issue 29 counted 21 launches a replayed step; the target is 2), each
    a few microseconds of host time in a step that is launch-bound. Its inputs are one int64 tensor whose size
    depends on the graph's (rows, width) alone, appended to the forward's static buffer, so a replay still costs one
    copy in and one launch. `key` names what `run` computes; it is part of the graph's key."""

    key: Hashable

    def inputs(self, rows: int, width: int) -> torch.Tensor:
        """This step's inputs as a host int64 tensor, for a graph of `rows` rows of `width` tokens (its own rows
        padded to that)."""

    def run(self, logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The tail's output from the logits [rows, width, V] and the inputs (on the device): tensor work alone,
        which may depend on `key` but not on any other attribute (the graph replays what its capture ran)."""


class GraphBackend(Protocol):
    def capture(self, forward: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        """Run `forward` (warm-up), capture it, and run the capture once; returns (replay, the static outputs
        each replay writes)."""


class TorchGraphs:
    """Graphs as torch's CUDA module names them; torch_npu's torch.npu mirrors the same names with NPUGraph."""

    def __init__(self, module, graph_class) -> None:
        self._module = module
        self._graph_class = graph_class
        self._pool = module.graph_pool_handle()  # one memory pool for every graph: they never run at once

    @classmethod
    def for_device(cls, device: torch.device) -> TorchGraphs | None:
        module = {"cuda": getattr(torch, "cuda", None), "npu": getattr(torch, "npu", None)}.get(device.type)
        graph_class = getattr(module, "CUDAGraph", None) or getattr(module, "NPUGraph", None)
        return cls(module, graph_class) if module is not None and graph_class is not None else None

    def capture(self, forward: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        """The warm-up runs on a side stream, as torch's capture needs (its first calls allocate and pick kernels)."""
        module = self._module
        side = module.Stream()
        side.wait_stream(module.current_stream())
        with module.stream(side):
            forward()
        module.current_stream().wait_stream(side)
        graph = self._graph_class()
        # thread_local: the engine's loop thread may allocate device memory (a new request's tensors) while the
        # compute thread captures; in torch's default (global) mode that would fail the capture
        options = {"capture_error_mode": "thread_local"} if module is torch.cuda else {}
        with module.graph(graph, pool=self._pool, **options):
            outputs = forward()
        graph.replay()
        return graph.replay, outputs


GraphKey = tuple[int, int, int, Hashable | None]  # (rows, width, span, the tail's key or None)


@dataclass
class _Captured:
    replay: Callable[[], None]
    buffer: torch.Tensor  # the static inputs, packed
    batch: ForwardBatch  # views into buffer
    outputs: Outputs


class StepGraphs:
    def __init__(self, body: Body, backend: GraphBackend, capture_sizes: Sequence[int], device: torch.device,
                 max_width: int = MAX_WIDTH, max_span: int | None = None,
                 gather_positions: int = GATHER_POSITIONS, head: Head | None = None) -> None:
        """max_span: the longest sequence (max_model_len), which no span floor exceeds. head: the logits of a
        forward's selected positions, which a GraphTail reads (without it, graphs take no tail)."""
        self._body = body
        self._head = head
        self._backend = backend
        self.capture_sizes = tuple(sorted(capture_sizes))
        self.device = device
        self.max_width = max_width
        self.max_span = power_of_two_at_least(max_span) if max_span else None
        self.gather_positions = gather_positions
        self._graphs: dict[GraphKey, _Captured] = {}
        self._uncapturable: set[GraphKey] = set()
        self.capture_seconds = 0.0

    @classmethod
    def for_runner(cls, body: Body, device: torch.device, max_num_seqs: int, max_model_len: int,
                   settings: GraphSettings, head: Head | None = None) -> StepGraphs | None:
        """None where forwards run eagerly: on CPU, without a graph API, or with enforce_eager."""
        backend = TorchGraphs.for_device(device)
        if settings.enforce_eager or backend is None:
            return None
        sizes = settings.capture_sizes or default_capture_sizes(max_num_seqs)
        return cls(body, backend, sizes, device, max_span=max_model_len, head=head)

    def span_floor(self, rows: int, width: int = 1) -> int:
        """The shortest span a graph of `rows` (padded) rows of `width` tokens reads: rows x width x span about
        GATHER_POSITIONS, a power of two, at least MIN_SPAN and at most the longest sequence's."""
        floor = max(MIN_SPAN, 1 << max(0, (self.gather_positions // (rows * width)).bit_length() - 1))
        return min(floor, self.max_span) if self.max_span else floor

    def shape_for(self, rows: int, width: int, span: int) -> tuple[int, int, int] | None:
        """(padded rows, width, span bucket) of the graph that runs this forward; None: it runs eagerly."""
        bucket = width_bucket(width)
        if bucket is None or bucket > self.max_width or rows > self.capture_sizes[-1]:
            return None
        padded = next(size for size in self.capture_sizes if size >= rows)
        return padded, bucket, max(self.span_floor(padded, bucket), power_of_two_at_least(span))

    def shapes_to_capture(self, max_width: int, tail: Hashable | None = None) -> list[tuple[int, int, int]]:
        """What the engine captures before its first step: every capture size by every width bucket a row of up
        to `max_width` tokens needs, over the size's span floor (shorter sequences; longer ones capture as they
        come), the graphs (with the tail of key `tail`) not yet captured."""
        widths = {bucket for width in range(1, min(max_width, self.max_width) + 1)
                  if (bucket := width_bucket(width)) is not None}
        shapes = [(rows, width, self.span_floor(rows, width)) for rows in self.capture_sizes
                  for width in sorted(widths)]
        return [shape for shape in shapes if (*shape, tail) not in self._graphs and (*shape, tail) not in
                self._uncapturable]

    def takes(self, shape: tuple[int, int, int], tail: GraphTail | None = None) -> bool:
        """Whether run() replays a graph for this shape (and tail), rather than returning None: not one whose
        capture failed, and a tail only where the graphs have a head to give it logits."""
        key = (*shape, None if tail is None else tail.key)
        return (tail is None or self._head is not None) and key not in self._uncapturable

    def run(self, batch: ForwardBatch, tail: GraphTail | None = None) -> tuple[torch.Tensor, ...] | None:
        """Replay (capturing first, for a new shape) the forward of a host batch padded to a graph's shape, and
        `tail` on its logits; returns the graph's static batch and its outputs: (batch, hidden, served states) and,
        with a tail, the tail's output. The next replay of that graph overwrites them. None when this shape could
        not be captured (logged once): the caller runs the forward eagerly."""
        rows, width = batch.input_ids.shape
        key = (rows, width, batch.span, None if tail is None else tail.key)
        if not self.takes(key[:3], tail):
            return None
        packed = batch.packed() if tail is None else torch.cat([batch.packed(), tail.inputs(rows, width)])
        captured = self._graphs.get(key)
        if captured is None:
            try:
                return self._capture(key, batch, packed, tail)
            except Exception:  # noqa: BLE001 - a capture the platform refuses costs speed, never a request
                logger.exception("capturing the forward of %d rows x %d tokens over %d positions (tail %s) failed; "
                                 "that shape runs eagerly", *key)
                self._uncapturable.add(key)
                return None
        captured.buffer.copy_(pinned(packed), non_blocking=True)  # queued before the replay, no host wait
        captured.replay()
        return captured.batch, *captured.outputs

    def _capture(self, key: GraphKey, batch: ForwardBatch, packed: torch.Tensor, tail: GraphTail | None):
        """Every run of the forward while capturing computes this very step (its K/V writes are the same each
        time), so the capture's own replay gives the step's outputs."""
        started = time.perf_counter()
        buffer = packed.to(self.device)
        static = batch.views_of(buffer)
        if tail is None:
            replay, outputs = self._backend.capture(lambda: self._body(static))
        else:
            tail_inputs = buffer[sum(t.numel() for t in batch.tensors.values()):]

            def forward_and_tail() -> Outputs:
                hidden, served = self._body(static)
                return hidden, served, tail.run(self._head(static, hidden), tail_inputs)

            replay, outputs = self._backend.capture(forward_and_tail)
        self._graphs[key] = _Captured(replay, buffer, static, outputs)
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        logger.info("captured the forward of %d rows x %d tokens over %d positions (tail %s) in %.2f s (%d graphs)",
                    *key, seconds, len(self._graphs))
        return static, *outputs

    def clear(self) -> None:
        """Forget every graph (what the forward computes changed: its served layers, a kept-states cache)."""
        self._graphs.clear()
        self._uncapturable.clear()

    def __len__(self) -> int:
        return len(self._graphs)

    def describe(self) -> str:
        return (f"captured graphs for up to {self.capture_sizes[-1]} rows of up to {self.max_width} tokens "
                f"(sizes {', '.join(map(str, self.capture_sizes))}; --enforce-eager to turn off)")
