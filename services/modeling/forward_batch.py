"""The index tensors of one runner forward, built on the host from the rows and the KV cache's block tables.

Everything a forward needs to know about its rows (tokens, rotary positions, where each fed token's K/V goes, which
pool positions each row reads, which positions need logits, a token tree's shape) is an integer tensor here, and
the masks are computed from them on the device (attention_masks). So the forward itself is a fixed sequence of
tensor operations for a given (rows, width, span): what a captured graph (step_graphs.py) replays, with this
batch copied into its static inputs as one buffer. A padded batch, for a graph, has extra rows that feed token 0,
write to the pool's sink slot and read nothing but the null block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np
import torch

from services.common.method_options import MAX_SPECULATIVE_TOKENS
from services.common.token_trees import tree_ancestors, tree_depths
from services.modeling.attention import additive_mask
from services.modeling.host_copies import to_device
from services.modeling.paged_kv_cache import PagedKVCache
from services.modeling.runner import RowInput


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [B, L] the fed tokens, right-padded with 0
    positions: torch.Tensor  # [B, L] rotary positions: start + j, or start + depth for a tree's node j
    fed_order: torch.Tensor  # [B, L] where fed token j is stored in its row's sequence: start + j
    starts: torch.Tensor  # [B] each row's cached length before this forward
    # [B, L, L] 1 where fed token i sees fed token j (lower-triangular for a chain); empty: every row a chain
    ancestors: torch.Tensor
    write_slots: torch.Tensor  # [N] pool slots the written K/V go to (a padded batch: every [B, L] position)
    write_rows: torch.Tensor  # [N] the row of each written position, row by row (all of a row's, then the next's)
    write_cols: torch.Tensor  # [N] its column
    select: torch.Tensor  # [B, L] column whose hidden state gives logits i (the last num_logits, clamped)
    # [B, span / block size] each row's blocks (PagedKVCache.block_table), read through as one padded gather
    # (PagedKVCache.read_index); empty: row by row
    block_table: torch.Tensor
    ends: torch.Tensor  # [B] each row's length after this forward (0 in padding rows)
    span: int  # key positions each row reads (T)
    row_reads: tuple[tuple[torch.Tensor | slice, int], ...] = ()  # row by row: (where, length) per row

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The integer tensors by field name, in field order (what a graph's static inputs hold)."""
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    def packed(self) -> torch.Tensor:
        """All tensors, flattened into one int64 buffer, in field order. A host batch's go through numpy: eleven
        reshapes, casts and a cat took 63-72 us of host time for a one-row batch here, numpy 37-43."""
        tensors = self.tensors.values()
        if all(t.device.type == "cpu" for t in tensors):
            return torch.from_numpy(np.concatenate([t.numpy().astype(np.int64, copy=False).reshape(-1)
                                                    for t in tensors]))
        return torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])

    def to(self, device: torch.device) -> ForwardBatch:
        """The batch with its tensors on `device`, copied as one packed buffer (row reads stay where they are)."""
        if self.input_ids.device == torch.device(device):
            return self
        return self.views_of(to_device(self.packed(), device))

    def views_of(self, buffer: torch.Tensor) -> ForwardBatch:
        """A batch of this shape whose tensors are views into `buffer` (laid out as packed() lays them out)."""
        views, offset = {}, 0
        for name, tensor in self.tensors.items():
            views[name] = buffer[offset : offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
        return replace(self, **views)


# The widest forward a token tree can be part of: up to MAX_SPECULATIVE_TOKENS nodes and the last committed token,
# padded up to a graph's width (step_graphs.WIDTH_BUCKETS: powers of two from 64). A graph this wide or narrower
# takes an [B, L, L] ancestor table, so that one graph serves chains and trees; wider ones (prefill chunks of 256
# and 512 tokens, never a tree) leave it out: at 512 it was 2 MB a row to build, pack and copy, 3.3 ms of host
# work for a one-row chunk on a 2-core Xeon.
TREE_CAPABLE_WIDTH = 2 * MAX_SPECULATIVE_TOKENS

TENSOR_FIELDS = tuple(f.name for f in fields(ForwardBatch) if f.name not in ("span", "row_reads"))


def build_forward_batch(
    cache: PagedKVCache,
    rows: Sequence[RowInput],
    starts: Sequence[int],
    device: torch.device,
    *,
    shape: tuple[int, int, int] | None = None,
    row_by_row: bool = False,
) -> ForwardBatch:
    """The batch for `rows` (their KV blocks reserved). shape = (rows, width, span) pads it to exactly that, for
    a captured graph or a batch-invariant forward: extra rows, extra columns, and `span` key positions read;
    every [B, L] position is then written, the padding into the cache's sink slot (with a shape, `rows` may be
    empty: a batch of padding alone, which a graph is captured from). row_by_row: read each row's
    positions as its own view or index instead of one padded gather (attention_paths.py)."""
    lengths = [len(r.token_ids) for r in rows]
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    batch, width, span = shape or (len(rows), max(lengths), max(ends))
    if batch < len(rows) or width < max(lengths, default=0) or span < max(ends, default=0):
        raise ValueError(f"shape {shape} is smaller than the rows' ({len(rows)}, {max(lengths)}, {max(ends)})")
    if shape is not None and row_by_row:
        raise ValueError("a batch padded to a shape reads through its block table, not row by row")
    pad_rows = batch - len(rows)
    padded_starts = np.array(list(starts) + [0] * pad_rows, dtype=np.int64)
    graph_shaped = shape is not None  # every position written, the padding to the sink
    columns = np.arange(width, dtype=np.int64)
    fed_columns = columns[None, :] < np.array(lengths, dtype=np.int64)[:, None]  # [rows, L]
    input_ids = np.zeros((batch, width), dtype=np.int64)  # [B, L]
    # row after row through one mask (a numpy slice per row cost about 1 us each)
    input_ids[: len(rows)][fed_columns] = np.fromiter(chain.from_iterable(r.token_ids for r in rows),
                                                      dtype=np.int64, count=sum(lengths))
    ancestors = np.zeros(0, dtype=np.int64)
    trees = any(r.parents is not None for r in rows)
    if trees and width > TREE_CAPABLE_WIDTH:
        raise ValueError(f"a token tree in a forward {width} tokens wide (at most {TREE_CAPABLE_WIDTH})")
    if trees or (graph_shaped and width <= TREE_CAPABLE_WIDTH):
        ancestors = np.repeat(np.tri(width, dtype=np.int64)[None], batch, axis=0)
    fed_order = padded_starts[:, None] + columns[None, :]
    positions = fed_order.copy()
    for b, row in enumerate(rows if trees else ()):
        if row.parents is None:
            continue
        depths = tree_depths(row.parents)
        if len(depths) != lengths[b]:
            raise ValueError(f"row {row.seq_id!r}: {len(depths)} parents for {lengths[b]} tokens")
        positions[b, : len(depths)] = starts[b] + np.asarray(depths, dtype=np.int64)
        ancestors[b, : len(depths), : len(depths)] = tree_ancestors(row.parents)
    row_reads: tuple[tuple[torch.Tensor | slice, int], ...] = ()
    if row_by_row:
        row_reads = tuple((cache.row_read(r.seq_id, end), end) for r, end in zip(rows, ends, strict=True))
        block_table = torch.empty(0, dtype=torch.int64)
    else:
        block_table = cache.block_table([r.seq_id for r in rows], span, pad_rows=pad_rows)
    if graph_shaped:
        write_slots = np.full((batch, width), cache.sink_slot, dtype=np.int64)
        if rows:
            slots = cache.table_slots(block_table.numpy()[: len(rows)], fed_order[: len(rows)])
            write_slots[: len(rows)] = np.where(fed_columns, slots, cache.sink_slot)
        write_slots = write_slots.reshape(-1)
        write_rows = np.repeat(np.arange(batch, dtype=np.int64), width)
        write_cols = np.tile(columns, batch)
    else:
        write_rows = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
        write_cols = np.concatenate([columns[:n] for n in lengths])
        if row_by_row:
            write_slots = np.array(
                [slot for r, s, e in zip(rows, starts, ends, strict=True) for slot in cache.slots(r.seq_id, s, e)],
                dtype=np.int64,
            )
        else:
            # from the block table, as a graph's batch: listed a slot at a time, one 512-token chunk's batch took
            # 99-104 us to build against 72-77 so (2-core EPYC)
            write_slots = cache.table_slots(block_table.numpy(), fed_order)[fed_columns]
    # logits i of a row come from its fed column n - num_logits + i, the last one repeated past num_logits (a row
    # that wants none: its last column); padding rows read column 0
    select = np.zeros((batch, width), dtype=np.int64)
    if rows:
        fed = np.array(lengths, dtype=np.int64)
        wanted = np.array([r.num_logits for r in rows], dtype=np.int64)
        first = np.where(wanted > 0, fed - wanted, fed - 1)
        select[: len(rows)] = first[:, None] + np.minimum(columns[None, :], np.maximum(wanted - 1, 0)[:, None])
    tensor = torch.from_numpy
    host = ForwardBatch(tensor(input_ids), tensor(positions), tensor(fed_order), tensor(padded_starts),
                        tensor(ancestors), tensor(write_slots), tensor(write_rows), tensor(write_cols), tensor(select),
                        block_table, tensor(np.array(ends + [0] * pad_rows, dtype=np.int64)), span, row_reads)
    return host.to(device)


def attention_masks(batch: ForwardBatch, windows: Sequence[int | None],
                    dtype: torch.dtype = torch.float32) -> dict[int | None, torch.Tensor]:
    """Additive masks [B, 1, L, span] per sliding window (None: none), of 0 and -inf in `dtype` (exact in any
    float type), from the batch's tensors alone (no host work, so a graph captures it): a fed token sees the cached
    positions before it and, among the fed tokens, its ancestors (the tokens before it, in a chain)."""
    key_index = torch.arange(batch.span, device=batch.input_ids.device)
    allowed = key_index[None, None, :] <= batch.fed_order[:, :, None]  # [B, L, T]
    key_positions = key_index[None, :]
    if batch.ancestors.numel():
        allowed, key_positions = _with_tree(batch, key_index, allowed)
    masks = {}
    for window in set(windows):
        near = key_positions[:, None, :] > batch.positions[:, :, None] - window if window is not None else None
        masks[window] = additive_mask(allowed if near is None else allowed & near, dtype)
    return masks


def _with_tree(batch: ForwardBatch, key_index: torch.Tensor, causal: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The mask and key positions where fed tokens see their ancestors only and sit at their depth."""
    rows, width = batch.input_ids.shape
    relative = key_index[None, :] - batch.starts[:, None]  # [B, T] a key's index among the fed tokens
    fed = (relative >= 0) & (relative < width)
    among_fed = relative.clamp(0, width - 1)
    sees_fed = batch.ancestors.gather(2, among_fed[:, None, :].expand(rows, width, -1)).bool()  # [B, L, T]
    allowed = torch.where(fed[:, None, :], sees_fed, causal)
    key_positions = torch.where(fed, batch.positions.gather(1, among_fed), key_index[None, :])  # [B, T]
    return allowed, key_positions
