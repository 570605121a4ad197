"""Captured EAGLE drafting: on an accelerator, the head steps of a drafting call replay one graph instead of
launching every step's kernels: a chain's K steps (draft_chains), or a token tree's levels
(eagle_tree_candidates.tree_candidates).

Why: the verifier's step replays a captured graph (services/modeling/step_graphs.py; 2.9 ms a step on an H200),
but EAGLE's chain ran eagerly, each head step a few dozen small kernels, so drafting K = 4 cost about as much as
verifying. With the shipped head reading bf16 states, a step commits 1.75 tokens at K = 4 (first token accepted
0.42 of the time; 1.86 and 0.46 in float32, measured on CPU with the head in either precision), so the issue's
1.5x at 1 request needs the whole chain to cost a small fraction of a step: one launch, not K x dozens. A tree
commits more a step (2.4-2.6 tokens at 24 nodes, top-8, depth 4, on CPU) but was over a thousand operations.

A call's drafting over B rows whose committed head caches are padded to S positions is a fixed computation of
(B, S, and the body's parameter: K for a chain, (topk, depth) for a tree). It is captured once per (rows padded
to a power of two, S rounded up to a power of two, parameter) and replayed with its inputs copied into that
graph's static buffers; rows past B are padding that attend only to their own new positions, and columns past a
row's cache are masked (the buffers start zeroed and only ever hold real K/V, so masked columns are finite).
Chains round K up to a power of two (draft more, cut). S has a floor of about HEAD_GATHER_POSITIONS / rows:
reading a few thousand masked positions costs a small batch of the head's one layer next to nothing, and one
graph then serves its sequences from their first token to a long context. (The verifier's step graphs, thirty
layers of K + 1 query tokens a row, take a lower floor: measured on an H100, step_graphs.py.)

The shapes a server meets are captured at start-up (capture_ahead: every row count up to its sequences, each span
bucket up to AHEAD_POSITIONS a graph, each parameter its calls can ask), as the verifier captures its step graphs:
captured as calls first met them, on an H200 each capture took ~0.15 s inside an ask, first asks missed the
verifier's 0.5 s draft deadline and EAGLE-3 at 8 chats averaged 103 ms an ask over a short run. Longer contexts
than that capture as they come. Graphs of one (rows, span) read one set of static buffers (they never run at
once): the buffers of a long span are most of a graph's memory.

What is captured is the eager body itself, so drafts are identical; a shape the platform refuses to capture runs
eagerly from then on. Pre-drafts (forced tokens, a stop between steps) and sampled q-trees run eagerly. CPU tests
replay through a backend that runs the body again; test_cuda_graphs_draft_what_eager_chains_and_trees_draft
captures real graphs where CUDA is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.modeling.eagle_head import DraftRows
from services.modeling.captured_shapes import CapturedShapes
from services.modeling.host_copies import pinned
from services.modeling.step_graphs import GraphBackend, TorchGraphs, power_of_two_at_least

logger = logging.getLogger(__name__)

MIN_SPAN = 64  # the fewest committed head positions a graph reads; longer caches round up to a power of two
HEAD_GATHER_POSITIONS = 4096  # a graph of r rows reads at least this / r head positions a row (span_floor)
MAX_ROWS = 256  # rows a graph takes at most; a larger call drafts eagerly
AHEAD_POSITIONS = 4 * HEAD_GATHER_POSITIONS  # capture_ahead: the most rows x span a graph captured at start-up reads

KV = tuple[torch.Tensor, torch.Tensor]


class ChainRow(Protocol):
    """One row of a drafting call, a chain or a tree (methods/eagle.py's ChainStart): its committed head cache
    ([1, kv heads, L, D] each, or None), the head position of its last committed token, that token and the head's
    feature of the target state before it ([1, H])."""

    cache: KV | None
    position: int
    token: int
    feature: torch.Tensor


@dataclass
class ChainInputs:
    """What a chain or a tree reads: padded caches [B, kv heads, S, D] (an eager call's with zero columns more, room
    for its own K/V: with_room), their real columns [B, S], and per row the token, feature [B, 1, H] and position
    it starts from."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor


# (inputs, the body's parameter) -> its output, [B, ...]: for a chain, K -> drafted target token ids [B, K]
HeadBody = Callable[[ChainInputs, Hashable], torch.Tensor]


def draft_chains(head, embed: torch.nn.Module, draft_rows: DraftRows, inputs: ChainInputs, k: int,
                 forcing: tuple[torch.Tensor, torch.Tensor] | None = None,
                 stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
    """K argmax steps of every row at once, each feeding back the head's own feature ([B, K] target token ids, on
    the head's device: nothing here waits for it). `forcing` ([B, F] ids, [B, F] where a row has one): tokens taken
    instead of the argmax at the first steps (a pre-draft's answered draft). None when `stop()` said so between
    steps. The captured chains replay exactly this.

    The chain's own K/V go into K columns after the committed ones, written in place (EagleHead.step_tree with one
    query a row), each step's query seeing the columns written so far: growing the cache by a cat at each step
    copied the whole padded cache K times (on a 2-core CPU, 8 sequences of 2,000 positions: a third of the ask).
    The K steps' positions, RoPE angles and attention masks (additive, as attention adds them) are made once for
    the chain, not at each step: on an accelerator each of those operations is a launch, inside a graph too."""
    rows, span = inputs.mask.shape
    device = inputs.mask.device
    keys, values = (with_room(kv, span, k) for kv in (inputs.keys, inputs.values))  # [B, kv heads, S + K, D]
    positions = inputs.positions[:, None] + torch.arange(k, device=device)  # [B, K]
    cos, sin = head.rotary.angles(positions, keys.dtype)  # [B, 1, K, D]
    own = torch.ones(k, k, dtype=torch.bool, device=device).tril()  # step j sees the chain's columns 0..j
    visible = torch.cat([inputs.mask[:, None].expand(rows, k, span), own.expand(rows, k, k)], dim=2)  # [B, K, S + K]
    masks = torch.zeros(visible.shape, dtype=keys.dtype, device=device).masked_fill_(~visible, float("-inf"))
    tokens, features = inputs.tokens, inputs.features
    steps = []
    for j in range(k):
        if j and stop is not None and stop():
            return None
        out = head.step_tree(embed(tokens[:, None]), features, positions[:, j : j + 1], keys, values,
                             masks[:, j : j + 1], span + j, (cos[:, :, j : j + 1], sin[:, :, j : j + 1]))
        tokens = head.token_ids(head.draft_scores(out[:, -1], draft_rows).argmax(-1))  # [B]
        if forcing is not None and j < forcing[0].shape[1]:
            tokens = torch.where(forcing[1][:, j], forcing[0][:, j].to(tokens.dtype), tokens)
        steps.append(tokens)
        features = out
    return torch.stack(steps, dim=1)


def with_room(kv: torch.Tensor, span: int, columns: int) -> torch.Tensor:
    """Keys or values [B, kv heads, >= span, D] as their first `span` columns followed by `columns` zero ones, to
    write a chain's or a tree's own K/V into: a view where the batch was padded with that room already (an eager
    call's, eagle_trees.padded_caches), else a padded copy (a graph's static buffers)."""
    if kv.shape[2] >= span + columns:
        return kv[:, :, : span + columns]
    return F.pad(kv[:, :, :span], (0, 0, 0, columns))


def span_floor(rows: int) -> int:
    """The fewest positions a graph of `rows` (a power of two) reads a row: HEAD_GATHER_POSITIONS / rows, from
    MIN_SPAN."""
    return max(MIN_SPAN, HEAD_GATHER_POSITIONS // rows)


@dataclass
class _StaticInputs:
    """The buffers a graph of (rows, span) reads, zeroed at first (masked columns stay finite). The caches are held
    position-major, [rows, span, kv heads, D], as a sequence's own head cache is (HeadSequence), so that each
    row's copy in is between two blocks of one layout, which _fill's one grouped copy needs; tokens, positions and
    cache lengths [3, rows] go in as one copy, and the mask is made from the lengths inside the graph."""

    keys: torch.Tensor
    values: torch.Tensor
    packed: torch.Tensor
    features: torch.Tensor

    def read(self) -> ChainInputs:
        """What the body reads (inside the capture: the mask is computed on each replay)."""
        span = self.keys.shape[1]
        mask = torch.arange(span, device=self.packed.device)[None, :] < self.packed[2][:, None]
        return ChainInputs(self.keys.transpose(1, 2), self.values.transpose(1, 2), mask, self.packed[0],
                           self.features, self.packed[1])


@dataclass
class _Captured:
    replay: Callable[[], None]
    inputs: _StaticInputs  # the static buffers the replay reads
    output: torch.Tensor  # [rows, ...], written by each replay


class HeadGraphs:
    def __init__(self, body: HeadBody, backend: GraphBackend, kv_heads: int, head_dim: int, hidden: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self._body = body
        self._backend = backend
        self._kv_heads, self._head_dim, self._hidden = kv_heads, head_dim, hidden
        self._dtype, self.device = dtype, device
        self._captures: CapturedShapes[_Captured] = CapturedShapes("EAGLE drafting (rows, span, parameter)")
        self._graphs = self._captures.graphs  # by (rows, span, the body's parameter)
        self._inputs: dict[tuple[int, int], _StaticInputs] = {}  # per (rows, span): what its graphs read

    @classmethod
    def for_device(cls, body: HeadBody, kv_heads: int, head_dim: int, hidden: int, dtype: torch.dtype,
                   device: torch.device) -> HeadGraphs | None:
        """None where drafting runs eagerly: on CPU or without a graph API."""
        backend = TorchGraphs.for_device(device)
        return None if backend is None else cls(body, backend, kv_heads, head_dim, hidden, dtype, device)

    @staticmethod
    def shape_for(rows: int, span: int, parameter: Hashable) -> tuple[int, int, Hashable] | None:
        """(padded rows, span, the body's parameter) of the graph that drafts for these rows; None: eagerly."""
        if rows > MAX_ROWS:
            return None
        padded = power_of_two_at_least(rows)
        return padded, max(span_floor(padded), power_of_two_at_least(span)), parameter

    @staticmethod
    def shapes_ahead(max_rows: int, parameters: Iterable[Hashable], max_span: int | None = None,
                     ) -> list[tuple[int, int, Hashable]]:
        """The shapes of calls of up to `max_rows` rows (padded to powers of two) with each parameter, over every
        span bucket from the rows' floor to AHEAD_POSITIONS / rows, and to no span past `max_span` (the longest
        sequence, when known) but the floor."""
        ceiling = None if max_span is None else power_of_two_at_least(max_span)
        shapes = []
        for rows in (1 << i for i in range(power_of_two_at_least(min(max_rows, MAX_ROWS)).bit_length())):
            span = span_floor(rows)
            spans = [span]
            while rows * span * 2 <= AHEAD_POSITIONS and (ceiling is None or span * 2 <= ceiling):
                span *= 2
                spans.append(span)
            shapes += [(rows, span, parameter) for span in spans for parameter in dict.fromkeys(parameters)]
        return shapes

    def capture_ahead(self, max_rows: int, parameters: Iterable[Hashable], max_span: int | None = None) -> int:
        """Capture now, before any call, the graphs of shapes_ahead not captured yet; returns how many were."""
        shapes = [key for key in self.shapes_ahead(max_rows, parameters, max_span) if not self._captures.known(key)]
        started = time.perf_counter()
        captured = sum(self._captures.get(key, lambda key=key: self._capture(key), ahead=True) is not None
                       for key in shapes)
        if shapes:
            logger.info("captured %d of %d EAGLE drafting graphs ahead (up to %d rows; %s) in %.1f s", captured,
                        len(shapes), shapes[-1][0], ", ".join(map(str, dict.fromkeys(k[2] for k in shapes))),
                        time.perf_counter() - started)
        return captured

    def run(self, rows: Sequence[ChainRow], parameter: Hashable) -> torch.Tensor | None:
        """The body's output for `rows` ([len(rows), ...] on the device); None where they must run eagerly."""
        span = max((0 if r.cache is None else r.cache[0].shape[2] for r in rows), default=0)
        key = self.shape_for(len(rows), span, parameter)
        captured = None if key is None else self._captures.get(key, lambda: self._capture(key))
        if captured is None:
            return None
        self._fill(captured.inputs, rows)
        captured.replay()
        return captured.output[: len(rows)]

    @property
    def capture_seconds(self) -> float:
        return self._captures.seconds

    def _capture(self, key: tuple[int, int, Hashable]) -> _Captured:
        """The body captured over the static buffers of its (rows, span) (raises where the platform refuses)."""
        static = self._inputs.get(key[:2])
        if static is None:
            static = self._inputs[key[:2]] = self._static_inputs(*key[:2])
        replay, output = self._backend.capture(lambda: self._body(static.read(), key[2]))
        return _Captured(replay, static, output)

    def _static_inputs(self, rows: int, span: int) -> _StaticInputs:
        options = {"device": self.device}
        keys = torch.zeros(rows, span, self._kv_heads, self._head_dim, dtype=self._dtype, **options)
        return _StaticInputs(keys, torch.zeros_like(keys), torch.zeros(3, rows, dtype=torch.int64, **options),
                             torch.zeros(rows, 1, self._hidden, dtype=self._dtype, **options))

    @staticmethod
    def _fill(static: _StaticInputs, rows: Sequence[ChainRow]) -> None:
        """Copy the rows into the static buffers: the caches device to device, all in one grouped copy; tokens,
        positions and cache lengths as one copy from pinned memory, without waiting; the features. Rows past
        len(rows) read nothing of their caches (length 0): their results are never read."""
        count = len(rows)
        into, sources = [], []
        for r, row in enumerate(rows):
            if row.cache is not None:
                length = row.cache[0].shape[2]
                for buffer, cache in zip((static.keys, static.values), row.cache, strict=True):
                    into.append(buffer[r, :length])  # [length, kv heads, D], one block, as the sequence's own
                    sources.append(cache[0].transpose(0, 1))
        if into:  # on CUDA one grouped kernel where a copy each was two launches a row
            torch._foreach_copy_(into, sources)
        packed = torch.zeros(static.packed.shape, dtype=torch.int64)
        packed[:, :count] = torch.tensor([(r.token, r.position, 0 if r.cache is None else r.cache[0].shape[2])
                                          for r in rows]).T
        static.packed.copy_(pinned(packed), non_blocking=True)
        static.features[:count] = torch.stack([r.feature for r in rows])

    def __len__(self) -> int:
        return len(self._captures)
