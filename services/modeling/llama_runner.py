"""Own forward for the llama / qwen2 / qwen3 / mistral family over a paged KV cache.

The weights and the per-token modules (embedding, RMSNorm, q/k/v/o projections with optional bias, q/k norms,
SwiGLU MLP, rotary tables) are the transformers model's own modules, called directly; only what decides speed
and batching is ours: a batch of rows, each fed at its own offset into its own KV blocks, attention through
two matmuls with per-row masks (attention.py), logits only for the positions asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

from services.modeling.attention_choice import choose_attention
from services.modeling.attention_paths import AttentionPaths
from services.modeling.batch_invariance import InvariantShape, waves
from services.modeling.cpu_linear import LinearFn
from services.modeling.forward_batch import ForwardBatch, attention_masks, build_forward_batch
from services.modeling.fused_linears import fuse_in_place
from services.modeling.fused_norm import norm_for
from services.modeling.hidden_layers import FINAL_LAYER, FINAL_ONLY, check_hidden_layers
from services.modeling.host_copies import DeviceToHost
from services.modeling.kernel_choice import KernelChooser, Site
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.paged_kv_cache import PagedKVCache
from services.modeling.runner import ForwardOutput, KVUsage, RowInput
from services.modeling.step_graphs import GraphSettings, GraphTail, StepGraphs
from services.modeling.weight_release import release_mapped

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
PINNED_READ_MAX_BYTES = 64 << 20  # the largest read of kept states into pinned memory (kept_hidden_states_of)


def supports(model: torch.nn.Module) -> bool:
    """Whether `model` has the module layout this runner calls into."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    inner = getattr(model, "model", None)
    return all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(
        model, "lm_head"
    )


@dataclass(frozen=True)
class LayerKernels:
    """Linears of one decoder layer, q/k/v and gate/up fused into one matmul each; each one runs plain
    F.linear or the oneDNN-packed kernel per number of token rows, as measured at start-up (kernel_choice.py)."""

    qkv: LinearFn
    qkv_sizes: tuple[int, int, int]
    o_proj: LinearFn
    gate_up: LinearFn
    down_proj: LinearFn

    @staticmethod
    def site_modules(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]]:
        """The modules of the layer's four linears, in forward order: q/k/v, o_proj, gate/up, down_proj."""
        attention, mlp = layer.self_attn, layer.mlp
        return [(attention.q_proj, attention.k_proj, attention.v_proj), (attention.o_proj,),
                (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]

    @staticmethod
    def sites(layer: torch.nn.Module) -> list[Site]:
        """The layer's four linears, in forward order, for KernelChooser.choose."""
        roles = ("q/k/v", "o_proj", "gate/up", "down_proj")
        return [(role, [m.weight for m in modules], [m.bias for m in modules])
                for role, modules in zip(roles, LayerKernels.site_modules(layer), strict=True)]

    @staticmethod
    def qkv_sizes_of(layer: torch.nn.Module) -> tuple[int, int, int]:
        attention = layer.self_attn
        return tuple(p.weight.shape[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj))

    @staticmethod
    def fused(layer: torch.nn.Module) -> LayerKernels:
        """Plain linears for an accelerator: q/k/v and gate/up one matmul each over their weights, concatenated
        in place (fused_linears.py); o_proj and down_proj the modules' own."""
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        return LayerKernels(fuse_in_place(projections), LayerKernels.qkv_sizes_of(layer), attention.o_proj,
                            fuse_in_place((mlp.gate_proj, mlp.up_proj)), mlp.down_proj)

    @staticmethod
    def build(qkv_sizes: tuple[int, int, int], linears: Sequence[LinearFn | None]) -> LayerKernels | None:
        """From the chooser's linears for `sites(layer)` and the layer's q/k/v sizes (read before its weights may
        be freed); None unless all four exist."""
        if any(k is None for k in linears):
            return None
        return LayerKernels(linears[0], qkv_sizes, linears[1], linears[2], linears[3])


class LlamaFamilyRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_model_len: int,
        pack_weights: bool = True,
        kernel_chooser: KernelChooser | None = None,
        kv_cache: KVCacheConfig | None = None,
        owns_model: bool = False,
        graphs: GraphSettings | None = None,
        batch_invariant: bool = False,
        allow_bf16: bool = False,
    ) -> None:
        """pack_weights: let each linear run oneDNN-packed weights (cpu_linear.py) at the token-row counts
        where a start-up measurement found them faster than F.linear (kernel_choice.py); a shape packed at
        some M keeps one more copy of its weights. False: the plain modules only, nothing measured.
        kernel_chooser: how that choice is measured (tests pass one with fake timings).
        kv_cache: the paged KV pool's memory budget, block size and prefix caching (kv_budget.py).
        owns_model: nothing but this runner calls the model's decoder layers (a verifier or drafter process), so
        each linear keeps one layout: one kernel per shape at every M, and the modules' own weights are freed
        where the packed copy was chosen (the one-copy rule: the weights are not twice in memory).
        graphs: on an accelerator, decode and verify forwards replay captured graphs (step_graphs.py) unless
        enforce_eager; CPU forwards run eagerly.
        batch_invariant: every forward runs as waves of one fixed shape, so that a token's logits do not depend on
        what else the forward carries (batch_invariance.py); token trees are then fed as their first path.
        allow_bf16: a drafter's runner: float32 linears may run a packed bfloat16 copy where measured faster
        (kernel_choice.KernelChooser). Never a verifier's: its products decide the output."""
        if not supports(model):
            raise ValueError(f"{type(model).__name__} is not a llama-family model this runner supports")
        config = model.config
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(config.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        layers = model.model.layers
        self.freed_weight_bytes = 0  # the modules' weights freed because only their packed copy runs
        self._chooser = (kernel_chooser or KernelChooser(one_layout=owns_model, allow_bf16=allow_bf16)) \
            if pack_weights else None
        self._kernels: list[LayerKernels | None] = [None] * len(layers)
        self._lm_head = model.lm_head
        if self._chooser is not None:
            head = model.lm_head
            sites = [site for layer in layers for site in LayerKernels.sites(layer)]
            qkv_sizes = [LayerKernels.qkv_sizes_of(layer) for layer in layers]  # before any weight is freed
            modules = [group for layer in layers for group in LayerKernels.site_modules(layer)]

            def free_unused(indices: list[int], linears: list[LinearFn | None]) -> None:
                """As each shape is chosen, before the next is packed: the peak holds one shape's copies. The
                shape's dropped weights are released together, reading the process's mappings once and not once
                a layer (SmolLM2's runner: 1.6-1.7 s to build, 1.9-2.1 before)."""
                dropped: list[torch.Tensor] = []
                for index, linear in zip(indices, linears, strict=True):
                    if index == len(modules):
                        self.freed_weight_bytes += free_packed_head(model, linear)
                    else:
                        dropped += drop_packed_site(modules[index], linear)
                self.freed_weight_bytes += sum(weight.nbytes for weight in dropped)
                release_mapped(dropped)  # a weight in a memory-mapped checkpoint is not freed by dropping it alone

            linears = self._chooser.choose([*sites, ("lm_head", [head.weight], [head.bias])],
                                           free_unused if owns_model else None)
            self._kernels = [LayerKernels.build(qkv_sizes[i], linears[4 * i : 4 * i + 4]) for i in range(len(layers))]
            self._lm_head = linears[-1] or head
        if self.device.type != "cpu" and all(kernels is None for kernels in self._kernels):
            self._kernels = [LayerKernels.fused(layer) for layer in layers]  # launch-bound: fewer, wider matmuls
        self._norm = norm_for(self.device, [n for layer in layers for n in (layer.input_layernorm,
                                                                            layer.post_attention_layernorm)]
                              + [model.model.norm])
        self._attention = choose_attention(self.device, self.dtype, self.num_heads, self.num_kv_heads, self.head_dim)
        self._windows = [self._sliding_window(layer.self_attn, config) for layer in layers]
        self.hidden_layers = FINAL_ONLY  # the states forward returns (hidden_layers.py); serve_hidden_layers sets them
        self.attention_paths = AttentionPaths.for_device(self.device)
        kv_cache = kv_cache or KVCacheConfig()
        bytes_per_token = PagedKVCache.bytes_per_token(len(layers), self.num_kv_heads, self.head_dim, self.dtype)
        num_blocks = kv_cache.num_blocks(bytes_per_token, max_model_len, max_num_seqs, self.device)
        self.cache = PagedKVCache(
            len(layers), self.num_kv_heads, self.head_dim, num_blocks, kv_cache.block_size, self.dtype, self.device,
            kv_cache.enable_prefix_caching,
        )
        self.graphs = StepGraphs.for_runner(self._body, self.device, max_num_seqs, max_model_len,
                                            graphs or GraphSettings(), head=self._head)
        self.invariant = InvariantShape.for_runner(max_num_seqs, max_model_len, kv_cache.block_size) \
            if batch_invariant else None
        # forward takes RowInput.parents and keep_path keeps one path of a fed tree; not in waves, which split rows
        self.supports_trees = not batch_invariant

    @property
    def kernel_measurement_s(self) -> float:
        """Start-up seconds spent timing kernel candidates (0 when nothing was measured)."""
        return self._chooser.measure_seconds if self._chooser else 0.0

    @property
    def kernels(self) -> str:
        """Which linear kernels the forward uses, one line for logs and benchmark reports."""
        layers = sum(k is not None for k in self._kernels)
        if self._chooser is None or not self._chooser.choices:
            return "F.linear, q/k/v and gate/up fused" if layers else "plain torch modules (F.linear)"
        rounded = " or a packed bfloat16 copy (bf16)" if self._chooser.allow_bf16 else ""
        text = (f"per-shape choice of F.linear (plain) or oneDNN-packed{rounded} by measurement: "
                f"{self._chooser.describe()}")
        if layers < len(self._kernels):
            text += f"; plain torch modules in {len(self._kernels) - layers} of {len(self._kernels)} layers"
        return text

    @property
    def attention_forms(self) -> str:
        """Which attention form runs for which query width, and the start-up times that chose them (on CUDA)."""
        return getattr(self._attention, "description", None) or getattr(self._attention, "__name__", "?")

    @staticmethod
    def _sliding_window(attention: torch.nn.Module, config) -> int | None:
        if hasattr(attention, "sliding_window"):
            return attention.sliding_window
        if config.model_type == "mistral":
            return getattr(config, "sliding_window", None)
        return None

    def _qkv(self, index: int, attention: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kernels = self._kernels[index]
        if kernels is None:
            return attention.q_proj(hidden), attention.k_proj(hidden), attention.v_proj(hidden)
        return kernels.qkv(hidden).split(kernels.qkv_sizes, dim=-1)

    def _rotated_qkv(self, index: int, attention: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys [B, L, Hq|Hkv, D] with rotary applied, and values. Where q/k/v come out of one fused
        matmul and no per-head norm sits before the rotation (qwen3's), queries and keys rotate as one tensor of
        Hq + Hkv heads: the same arithmetic per element as transformers' apply_rotary_pos_emb, in half the
        operations (SmolLM2: 150 fewer a forward, each a kernel launch on an accelerator)."""
        rows, width = hidden.shape[:2]
        kernels = self._kernels[index]
        if kernels is None or hasattr(attention, "q_norm"):
            q, k, v = (t.view(rows, width, -1, self.head_dim) for t in self._qkv(index, attention, hidden))
            if hasattr(attention, "q_norm"):  # qwen3
                q, k = attention.q_norm(q), attention.k_norm(k)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            return q, k, v
        fused = kernels.qkv(hidden).view(rows, width, -1, self.head_dim)  # [B, L, Hq + 2 Hkv, D]: q, k, v heads
        rotated = self.num_heads + self.num_kv_heads
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        qk = fused[:, :, :rotated]
        qk = qk * cos + rotate_half(qk) * sin
        return qk[:, :, : self.num_heads], qk[:, :, self.num_heads :], fused[:, :, rotated:]

    def _o_proj(self, index: int, attention: torch.nn.Module, attended: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels[index]
        return attention.o_proj(attended) if kernels is None else kernels.o_proj(attended)

    def _mlp(self, index: int, mlp: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels[index]
        if kernels is None:
            return mlp(hidden)
        gate, up = kernels.gate_up(hidden).chunk(2, dim=-1)
        return kernels.down_proj(mlp.act_fn(gate) * up)

    # -- sequence bookkeeping -------------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        if len(self.cache) >= self.max_num_seqs:
            raise RuntimeError(f"no free sequence slot (max_num_seqs={self.max_num_seqs})")
        return self.cache.add(seq_id, prompt)

    def remove_sequence(self, seq_id: Hashable) -> None:
        self.cache.remove(seq_id)

    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self.cache)

    def length(self, seq_id: Hashable) -> int:
        return self.cache.length(seq_id)

    def truncate(self, seq_id: Hashable, length: int) -> None:
        if length > self.cache.length(seq_id):
            raise ValueError("truncate can only shorten a sequence")
        self.cache.truncate(seq_id, length)

    def keep_path(self, seq_id: Hashable, start: int, path: Sequence[int]) -> None:
        self.cache.keep_path(seq_id, start, path)

    def kv_blocks_needed(self, seq_id: Hashable | None, length: int) -> int:
        return self.cache.blocks_needed(seq_id, length)

    def kv_blocks_available(self) -> int:
        return self.cache.num_available_blocks()

    def reserve(self, seq_id: Hashable, length: int) -> None:
        self.cache.reserve(seq_id, length)

    def serve_hidden_layers(self, layers: Sequence[int]) -> None:
        """Return the states of these target layers, concatenated, as ForwardOutput.hidden_states (hidden_layers.py;
        default: the final normed one). Set while no sequence is held; states kept for other layers are dropped
        (keep_hidden_states keeps them again)."""
        layers = check_hidden_layers(layers, len(self.model.model.layers))
        if layers != self.hidden_layers:
            self.cache.forget_hidden_states()
            self._forget_graphs()
        self.hidden_layers = layers

    def keep_hidden_states(self) -> None:
        """Keep every position's served hidden states beside its K/V (paged_kv_cache.keep_hidden_states)."""
        if self.cache.hidden is None:
            self._forget_graphs()
        self.cache.keep_hidden_states(len(self.hidden_layers) * self.model.config.hidden_size, self.dtype)

    @torch.inference_mode()
    def capture_graphs(self, max_width: int, tails: Sequence[GraphTail] = ()) -> int:
        """Capture the step graphs of short sequences up to `max_width` tokens a row now, before any request
        (step_graphs.shapes_to_capture), plain and with each of `tails` (forward_with_tail), each from a batch of
        padding alone: its writes go to the sink slot, its reads to the null block. Returns how many were captured;
        0 where forwards run eagerly."""
        if self.graphs is None or self.invariant is not None:
            return 0
        captured = 0
        for tail in (None, *tails):
            shapes = self.graphs.shapes_to_capture(max_width, None if tail is None else tail.key)
            for shape in shapes:
                self.graphs.run(build_forward_batch(self.cache, [], [], torch.device("cpu"), shape=shape), tail)
            captured += len(shapes)
        return captured

    def _forget_graphs(self) -> None:
        """The forward now computes something else (other served layers, kept states): capture it again."""
        if self.graphs is not None:
            self.graphs.clear()

    @property
    def caches_hidden_states(self) -> bool:
        return self.cache.hidden is not None

    def kept_hidden_states_of(self, ranges: Sequence[tuple[Hashable, int, int]]) -> torch.Tensor:
        """[sum of the ranges' lengths, layers * H] on the host: the kept states of each (sequence, start, stop)
        range's positions, in order, gathered on the device and copied in one transfer (runner_kept_states.py:
        a request's states stay here until its drafter reads them). On CUDA into pinned memory, as the step's own
        copies (DeviceToHost), which the driver would otherwise stage; but a read larger than PINNED_READ_MAX_BYTES
        goes to pageable memory: torch's caching host allocator keeps each pinned block it allocates for reuse until
        told to empty its cache, and an ask that opens 64 chats of 2,000 tokens reads some 440 MB of EAGLE-3's
        states."""
        states = self.cache.hidden_states_of(ranges)
        if states.numel() * states.element_size() > PINNED_READ_MAX_BYTES:
            return states.cpu()
        to_host = DeviceToHost()
        states = to_host.queue(states)
        to_host.wait()
        return states

    @property
    def kv_usage(self) -> KVUsage:
        pool = self.cache.pool
        return KVUsage(pool.capacity_blocks, pool.capacity_blocks - pool.num_available(), pool.num_cached(),
                       pool.block_size, pool.stats)

    # -- forward --------------------------------------------------------------------------------------------
    def _checked(self, rows: Sequence[RowInput]) -> tuple[list[int], list[int]]:
        """Each row's cached length and tokens fed, after checking the rows fit."""
        if not rows:
            raise ValueError("forward needs at least one row")
        starts = [self.cache.length(r.seq_id) for r in rows]
        lengths = [len(r.token_ids) for r in rows]
        for row, start, n in zip(rows, starts, lengths, strict=True):
            if n == 0 or not 0 <= row.num_logits <= n:
                raise ValueError(f"row {row.seq_id!r}: {n} tokens, {row.num_logits} logits asked")
            if start + n > self.max_model_len:
                raise ValueError(f"row {row.seq_id!r} would exceed max_model_len={self.max_model_len}")
            if row.parents is not None and len(row.parents) != n:
                raise ValueError(f"row {row.seq_id!r}: {len(row.parents)} parents for {n} tokens")
        return starts, lengths

    def padded_shape(self, rows: int, width: int, span: int) -> tuple[int, int, int]:
        """The (rows, width, span) a forward of `rows` rows of up to `width` tokens over `span` positions really
        runs at: its captured graph's, padded (step_graphs.py), where a graph replays it; itself where it runs
        eagerly. What a step costs follows this shape (step_cost.py prices widths by it)."""
        if self.graphs is None or self.invariant is not None:
            return rows, width, span
        return self.graphs.shape_for(rows, width, span) or (rows, width, span)

    @torch.inference_mode()
    def forward_with_tail(self, rows: Sequence[RowInput], tail: GraphTail, launched: Callable[[], None] = lambda: None
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The forward of the rows (every fed position's logits; trees where the tail `feeds_trees`, which a graph's
        ancestor table carries: forward_batch.py) with `tail` run on its logits [B, L, V] inside
        the step's captured graph, where no logits leave the device and nothing is launched but the replay. Returns
        (the tail's output, its rows padded to the graph's; the served states [B, L, layers * H]), both the graph's
        own, which the next forward overwrites; None, with nothing done, where no captured graph takes this forward
        (CPU, --enforce-eager, the batch-invariant mode, a shape beyond the graphs, a capture that failed): the
        caller then runs forward(). Calls `launched` once the replay is queued (the engine's loop waits for it:
        Engine.step says why)."""
        if self.graphs is None or self.invariant is not None:
            return None
        if not getattr(tail, "feeds_trees", False) and any(r.parents is not None for r in rows):
            return None
        starts, lengths = self._checked(rows)
        shape = self.graphs.shape_for(len(rows), max(lengths), max(s + n for s, n in zip(starts, lengths, strict=True)))
        if shape is None or not self.graphs.takes(shape, tail):
            return None
        for row, start, n in zip(rows, starts, lengths, strict=True):
            self.cache.reserve(row.seq_id, start + n)
        batch = build_forward_batch(self.cache, rows, starts, torch.device("cpu"), shape=shape)
        replayed = self.graphs.run(batch, tail)
        if replayed is None:  # the capture failed just now: the caller's forward() writes the same K/V again
            return None
        launched()
        _, _, served, out = replayed
        for row in rows:
            self.cache.append_tokens(row.seq_id, row.token_ids, publish=row.parents is None)
        served = served[: len(rows)]
        if served.device.type == "cpu":  # graphs on CPU are tests' rerun backends; a host copy would be served itself
            served = served.clone()
        return out, served

    @torch.inference_mode()
    def forward(self, rows: Sequence[RowInput]) -> ForwardOutput:
        starts, lengths = self._checked(rows)
        for row, start, n in zip(rows, starts, lengths, strict=True):
            self.cache.reserve(row.seq_id, start + n)
        if self.invariant is not None:
            return self._forward_in_waves(rows)
        replayed = self._replay(rows, starts, lengths) if self.graphs is not None else None
        if replayed is not None:
            batch, hidden, served = replayed
        else:
            mean_span, width = (sum(starts) + sum(lengths)) / len(rows), max(lengths)
            row_by_row = self.attention_paths.row_by_row(len(rows), mean_span, width)
            started = time.perf_counter()
            batch = build_forward_batch(self.cache, rows, starts, self.device, row_by_row=row_by_row)
            hidden, served = self._body(batch)
            if self.attention_paths.learn:  # a CPU forward has run when _body returns
                self.attention_paths.observe(len(rows), mean_span, width, row_by_row, time.perf_counter() - started)
        for row in rows:
            self.cache.append_tokens(row.seq_id, row.token_ids, publish=row.parents is None)
        select = batch.select[: len(rows), : max(r.num_logits for r in rows)]  # [B, M]
        return ForwardOutput(logits=self._selected_logits(select, hidden), hidden_states=served)

    def _head(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, V] of every column the batch selects: what a graph with a tail computes (step_graphs.py)."""
        return self._selected_logits(batch.select, hidden)

    def _selected_logits(self, select: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, M, V] of the hidden states [B, L, H] at columns `select` [B, M]."""
        selected = hidden.gather(1, select[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, M, H]
        return self._lm_head(selected).float()

    def _forward_in_waves(self, rows: Sequence[RowInput]) -> ForwardOutput:
        """The batch-invariant forward: waves of the one fixed shape (batch_invariance.py), logits computed for the
        whole fixed block, each row's pieces put back together."""
        if any(row.parents is not None for row in rows):
            raise ValueError("a batch-invariant runner feeds chains only (it splits rows into waves)")
        shape = self.invariant
        logits_parts: list[list[torch.Tensor]] = [[] for _ in rows]
        served_parts: list[list[torch.Tensor]] = [[] for _ in rows]
        for wave in waves([len(row.token_ids) for row in rows], shape):
            pieces = [RowInput(rows[b].seq_id, rows[b].token_ids[first:stop]) for b, first, stop in wave]
            starts = [self.cache.length(piece.seq_id) for piece in pieces]
            _, hidden, served = self._run_shaped(pieces, starts, shape.as_tuple)
            logits = self._lm_head(hidden.reshape(shape.rows * shape.width, -1)).float()  # one shape, every wave
            logits = logits.view(shape.rows, shape.width, -1)
            for i, ((b, first, stop), piece) in enumerate(zip(wave, pieces, strict=True)):
                logits_parts[b].append(logits[i, : stop - first])
                served_parts[b].append(served[i, : stop - first].clone())  # a replay overwrites the graph's own
                self.cache.append_tokens(piece.seq_id, piece.token_ids)
        width = max(len(row.token_ids) for row in rows)
        wanted = max(row.num_logits for row in rows)
        out_logits = torch.zeros(len(rows), wanted, self.vocab_size, device=self.device)
        out_served = torch.zeros(len(rows), width, served.shape[-1], dtype=served.dtype, device=self.device)
        for b, row in enumerate(rows):
            row_logits, n = torch.cat(logits_parts[b]), len(row.token_ids)
            out_logits[b, : row.num_logits] = row_logits[n - row.num_logits :]
            out_served[b, :n] = torch.cat(served_parts[b])
        return ForwardOutput(logits=out_logits, hidden_states=out_served)

    def _replay(self, rows: Sequence[RowInput], starts: list[int], lengths: list[int]):
        """The forward padded to a captured graph's shape: (its batch, hidden [B, L, H], served states) of the
        rows; None where no graph takes this shape."""
        span = max(s + n for s, n in zip(starts, lengths, strict=True))
        shape = self.graphs.shape_for(len(rows), max(lengths), span)
        if shape is None:
            return None
        batch, hidden, served = self._run_shaped(rows, starts, shape)
        return batch, hidden[: len(rows)], served[: len(rows)].clone()  # the next replay overwrites them

    def _run_shaped(self, rows: Sequence[RowInput], starts: list[int], shape: tuple[int, int, int]):
        """The forward of `rows` padded to `shape`: a graph's replay where there are graphs (its inputs built on the
        host, copied in as one buffer), else, or where that shape cannot be captured, the same padded batch eagerly.
        Returns (the batch, hidden [shape rows, L, H], served states); a replay's outputs are the graph's own."""
        on_host = self.graphs is not None
        batch = build_forward_batch(self.cache, rows, starts, torch.device("cpu") if on_host else self.device,
                                    shape=shape)
        replayed = self.graphs.run(batch) if on_host else None
        if replayed is not None:
            return replayed
        batch = batch.to(self.device)
        return (batch, *self._body(batch))

    def _body(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's tensor work, from the batch's tensors alone (what a graph captures): K/V written into
        the pool and read back through it, the served hidden states kept where asked. Returns the final normed
        hidden states [B, L, H] and the served ones [B, L, layers * H]."""
        rows, width = batch.input_ids.shape
        span = batch.span
        masks = attention_masks(batch, self._windows, self.dtype)
        if not batch.row_reads:
            batch_read = self.cache.read_index(batch.block_table, batch.ends, span)  # [Hkv * B * span]
            shape = (self.num_kv_heads, rows * span, self.head_dim)  # one buffer per forward, not per layer
            gathered = (torch.empty(shape, dtype=self.dtype, device=self.device),
                        torch.empty(shape, dtype=self.dtype, device=self.device))
        inner = self.model.model
        hidden = inner.embed_tokens(batch.input_ids)  # [B, L, H]
        cos, sin = inner.rotary_emb(hidden, batch.positions)
        captured: dict[int, torch.Tensor] = {}  # the residual stream entering layer i, where served
        for index, layer in enumerate(inner.layers):
            if index in self.hidden_layers:
                captured[index] = hidden
            attention = layer.self_attn
            residual = hidden
            hidden = self._norm(layer.input_layernorm, hidden)
            q, k, v = self._rotated_qkv(index, attention, hidden, cos, sin)  # [B, L, Hq|Hkv, D]
            layer_keys, layer_values = self.cache.keys[index], self.cache.values[index]  # [Hkv, slots, D]
            layer_keys[:, batch.write_slots] = written(k, batch).transpose(0, 1)  # [Hkv, N, D]
            layer_values[:, batch.write_slots] = written(v, batch).transpose(0, 1)
            mask = masks[self._windows[index]]
            if not batch.row_reads:
                keys = read_layer(layer_keys, batch_read, rows, span, gathered[0])
                values = read_layer(layer_values, batch_read, rows, span, gathered[1])
                attended = self._attention(q, keys, values, mask, attention.scaling)
            else:  # each row over its own positions, unpadded
                attended = torch.cat([
                    self._attention(q[b : b + 1], read_layer(layer_keys, read, 1, end),
                                    read_layer(layer_values, read, 1, end), mask[b : b + 1, :, :, :end],
                                    attention.scaling)
                    for b, (read, end) in enumerate(batch.row_reads)
                ])
            hidden = residual + self._o_proj(index, attention, attended)  # attended: [B, L, Hq*D]
            residual = hidden
            hidden = residual + self._mlp(index, layer.mlp, self._norm(layer.post_attention_layernorm, hidden))
        hidden = self._norm(inner.norm, hidden)  # [B, L, H]
        captured[FINAL_LAYER] = hidden
        served = hidden if self.hidden_layers == FINAL_ONLY else torch.cat(
            [captured[i] for i in self.hidden_layers], dim=-1)  # [B, L, layers * H]
        if self.cache.hidden is not None:
            self.cache.hidden[batch.write_slots] = written(served, batch)
        return hidden, served


def written(per_position: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The written positions' rows of `per_position` ([B, L, ...]: K, V, served states) as [N, ...], in the batch's
    write order, which is row by row (build_forward_batch). Where every [B, L] position is written (a graph's
    padded batch, rows of one width) that is a reshape, not a gather: on an accelerator, a kernel fewer for K and
    for V in every layer."""
    rows, width = per_position.shape[:2]
    if batch.write_rows.numel() == rows * width:
        return per_position.reshape(rows * width, *per_position.shape[2:])
    return per_position[batch.write_rows, batch.write_cols]


def runs_packed_only(linear: LinearFn | None) -> bool:
    """Whether a chooser's linear runs a packed copy (its precision or bfloat16) at every M, never the module."""
    choice = getattr(linear, "choice", None)
    return choice is not None and "plain" not in choice.chosen


def drop_packed_site(modules: Sequence[torch.nn.Module], linear: LinearFn | None) -> list[torch.Tensor]:
    """Drop the module weights of one decoder-layer linear (q/k/v, o_proj, gate/up or down_proj) where a packed
    copy runs at every M, in their precision or as a drafter's bfloat16 copy; returns the dropped weights, whose
    pages in a memory-mapped checkpoint the caller releases (release_mapped). A dropped module is left with an
    empty weight, so calling it fails loudly instead of computing with nothing."""
    if not runs_packed_only(linear):
        return []
    dropped = []
    for module in modules:
        dropped.append(module.weight.detach())
        module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    return dropped


def free_packed_head(model: torch.nn.Module, head: LinearFn | None) -> int:
    """The LM head's counterpart of drop_packed_site, releasing what it drops itself, when a packed copy runs at
    every M; returns the bytes given back. An untied head's weight is freed like a layer's. A head tied to the
    input embedding (SmolLM2, Qwen2.5) cannot be freed: the embedding looks rows up in it. Where that weight lies
    in the checkpoint's file mapping, its resident pages are dropped instead (the packing read all of it): a
    lookup faults back the page of the row it reads, so only the rows of tokens actually seen stay resident, and
    the pages are the file's, which the kernel can drop again under pressure (SmolLM2: 108 MiB of the 49152 x 576
    table)."""
    if not runs_packed_only(head):
        return 0
    weight = model.lm_head.weight.detach()
    if weight.untyped_storage().data_ptr() == model.get_input_embeddings().weight.untyped_storage().data_ptr():
        return release_mapped([weight])
    model.lm_head.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
    release_mapped([weight])  # in a file mapping, dropping the tensor alone frees nothing
    return weight.nbytes


def read_layer(
    layer: torch.Tensor, read: torch.Tensor | slice, batch: int, span: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One layer's K or V ([Hkv, slots, D]) for the batch: [Hkv, B, span, D], a view or a gather of its rows
    (PagedKVCache.row_read / read_index) into `out` ([Hkv, B * span, D]) when given."""
    heads, _, head_dim = layer.shape
    if isinstance(read, slice):
        return layer[:, read][:, None]
    rows = layer.view(-1, head_dim)
    gathered = torch.index_select(rows, 0, read, out=out.view(-1, head_dim) if out is not None else None)
    return gathered.view(heads, batch, span, head_dim)
