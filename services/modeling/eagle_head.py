"""An EAGLE-1 head for a llama-family target: one decoder layer over [token embedding; target feature].

At position t the head reads the embedding of token x_{t+1} and the target's feature f_t (its final, normed
hidden state at t, what the runners return as `hidden_states`) and predicts f_{t+1}; the target's own LM head turns
that into a draft of x_{t+2}. Drafting a chain feeds the head its own prediction as the next feature.

A head may draft from a reduced vocabulary (EAGLE-3's idea): `draft_vocab` lists the target token ids it can
propose (the most frequent in the target's own answers), and only those rows of the target's LM head are scored.
The LM head is most of a draft step's cost on a small model (49,152 x 576 for SmolLM2-135M against the layer's 4 M
weights), so 8,192 rows make a step several times cheaper, in training and in serving; a token outside the list is
never drafted (its draft would have been rare, and the verifier's output never depends on what is drafted).

The target's embedding and LM head are shared, never copied into the head (they are most of a small model's
weights). The layer is written out (RMSNorm, RoPE, grouped-query attention, SwiGLU) rather than taken from
transformers because training unrolls it over several drafting steps whose keys mix (`unrolled`), which needs
an attention it controls. `step` runs it incrementally with a per-sequence KV cache, as a drafter would.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "eagle_config.json"


@dataclass(frozen=True)
class DraftRows:
    """The LM head rows a head scores ([Vd, H]: its draft vocabulary's) and the matmul that applies them to
    outputs [..., H]. A drafter on CPU applies them through the kernel measured fastest there
    (services/drafter/head_kernels.py); `plain` is the plain product, which training also uses."""

    weight: torch.Tensor
    linear: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def plain(cls, weight: torch.Tensor) -> DraftRows:
        return cls(weight, lambda outputs: outputs @ weight.T)


@dataclass(frozen=True)
class HeadShape:
    """The head's decoder layer (its width, MLP, heads, norm, RoPE) and the target's vocabulary: what every EAGLE
    head's config starts with (Eagle3Config too)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def target_layer_width(self) -> int:
        """The width of one target layer's state it reads: the head's own width (an EAGLE-3 head may differ)."""
        return self.hidden_size


@dataclass(frozen=True)
class EagleConfig(HeadShape):
    target: str = ""  # the target model it was trained for (a --model spec)
    draft_vocab_size: int = 0  # > 0: drafts come from `EagleHead.draft_vocab` only; 0: the whole vocabulary
    # RMSNorm on the fc output before attention (specserve's heads); the published EAGLE-1 heads have none
    input_norm: bool = True
    fc_bias: bool = True  # the published EAGLE-1 heads' fc may have no bias

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers it reads (services/modeling/hidden_layers.py): the final, normed one."""
        return (-1,)

    @staticmethod
    def for_target(config, target: str = "") -> EagleConfig:
        theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0)
        return EagleConfig(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                           config.num_key_value_heads, config.rms_norm_eps, float(theta), config.vocab_size, target)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * (x / rms(x)), normalized in float32 and rounded to x's dtype before the weight (llama's
        RMSNorm), in one kernel and a multiply: the written-out form was eight kernels, four norms of an EAGLE-3
        draft step (bit-identical on CPU in float32 and bfloat16)."""
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


Angles = tuple[torch.Tensor, torch.Tensor]  # RoPE's cos and sin at some positions (Rotary.angles)


class Rotary:
    """RoPE (the llama half-split convention) with its inverse frequencies computed once per device, in float32.
    A head step takes the angles of its positions once (`angles`) and turns its queries and keys with them
    (`turn`): computed apart for each, with the frequencies, they were about 30 of the ~85 kernels of a draft step
    (on an accelerator each is a launch, inside the captured chain too)."""

    def __init__(self, dim: int, theta: float) -> None:
        self.dim, self.theta = dim, theta
        self._inverse: dict[torch.device, torch.Tensor] = {}

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        """cos and sin at integer positions [T] (shared by the rows) or [B, T] (each row its own), in `dtype`:
        [T, D], or [B, 1, T, D] to broadcast over heads."""
        inverse = self._inverse.get(positions.device)
        if inverse is None:
            arange = torch.arange(0, self.dim, 2, device=positions.device, dtype=torch.float32)
            inverse = self._inverse[positions.device] = 1.0 / (self.theta ** (arange / self.dim))
        angles = positions.float()[..., None] * inverse  # [(B,) T, D/2]
        both = torch.cat([angles, angles], -1)
        cos, sin = both.cos().to(dtype), both.sin().to(dtype)
        return (cos[:, None], sin[:, None]) if positions.dim() == 2 else (cos, sin)

    @staticmethod
    def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D] turned by `angles`' cos and sin."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention of queries [B, Hq, T, D] over keys and values [B, Hkv, L, D] (Hq a multiple of Hkv, each
    KV head serving a group of consecutive query heads), query t reading the columns `visible` [B, T or 1, L]
    marks (at least one each); [B, Hq, T, D]. Each KV head's query group is folded into the query length, so it
    is one scaled_dot_product_attention call over the keys as they lie: repeating them for every query head, as
    the written-out form did, copied the whole cache twice a step (on CPU, float32: 10.5 -> 0.5 ms at 32 rows x
    256 positions, 1.1 -> 0.3 ms at one row x 4,096)."""
    batch, heads, length, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    folded = q.reshape(batch, kv_heads, groups * length, dim)  # row g * T + t: query head kv * G + g, query t
    mask = visible.repeat(1, groups, 1) if visible.shape[1] > 1 else visible  # row g * T + t reads visible[t]
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask[:, None])
    return out.reshape(batch, heads, length, dim)


class EagleHead(nn.Module):
    # its outputs are predictions of the target's next feature, scored by the target's LM head (training adds a
    # regression on them); an EAGLE-3 head's are not
    predicts_target_features = True
    # q/k/v and gate/up as one matmul each, where fuse_sibling_linears set them (an accelerator's drafter)
    _fused_qkv: Callable[[torch.Tensor], torch.Tensor] | None = None
    _fused_gate_up: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.input_norm = RMSNorm(h, config.rms_norm_eps) if config.input_norm else nn.Identity()
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.rotary = Rotary(d, config.rope_theta)
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None

    def fuse_sibling_linears(self) -> None:
        """Run q/k/v and gate/up as one matmul each over their weights side by side (fused_linears.fuse_in_place:
        the modules' weights become views of the concatenation, so nothing is held twice). For an accelerator,
        where each matmul of a draft step is a launch; on CPU the head's chosen kernels fuse nothing and replace
        the modules instead (services/drafter/head_kernels.py)."""
        from services.modeling.fused_linears import fuse_in_place

        self._fused_qkv = fuse_in_place([self.q_proj, self.k_proj, self.v_proj])
        self._fused_gate_up = fuse_in_place([self.gate_proj, self.up_proj])

    # -- the draft vocabulary ----------------------------------------------------------------------------------
    def draft_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head [V, H] this head scores: [Vd, H] for a reduced vocabulary."""
        return lm_head_weight if self.draft_vocab is None else lm_head_weight[self.draft_vocab]

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of indices into the rows `draft_weight` returned."""
        return indices if self.draft_vocab is None else self.draft_vocab[indices]

    def token_embedding(self, target_embedding: nn.Module) -> nn.Module:
        """The embedding it reads tokens through: its own where a checkpoint ships one (some EAGLE-3 heads), else
        the target's."""
        return getattr(self, "embed_tokens", None) or target_embedding

    def target_features(self, states: torch.Tensor) -> torch.Tensor:
        """The head's feature of the target's hidden states as the verifier sends them: EAGLE-1 reads the final
        state as it is (an EAGLE-3 head fuses several layers here)."""
        return states

    def draft_logits(self, outputs: torch.Tensor, draft_weight: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary of the head's outputs [..., H], `draft_weight` being what
        `draft_weight` returned (taken once by a drafter: indexing the LM head every step would cost more)."""
        return self.draft_scores(outputs, DraftRows.plain(draft_weight))

    def draft_scores(self, outputs: torch.Tensor, rows: DraftRows) -> torch.Tensor:
        """draft_logits through the rows' own matmul (a drafter's)."""
        return rows.linear(outputs)

    # -- pieces ----------------------------------------------------------------------------------------------
    def _inputs(self, embeddings: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads at each position, and the residual it adds to: EAGLE-1 fuses [embedding;
        feature] into one vector that is both."""
        x = self.fc(torch.cat([embeddings, features], dim=-1))  # [B, T, H]
        return self.input_norm(x), x

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, angles: Angles | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, heads, T, D] queries, keys and values of the attention inputs at `positions`, queries and keys turned
        together (one RoPE for both). `angles`: Rotary.angles of `positions`, where a caller took several steps'
        at once."""
        c = self.config
        b, t, _ = x.shape
        sizes = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim)
        if self._fused_qkv is not None:
            q, k, v = self._fused_qkv(x).split([sizes[0], sizes[1], sizes[1]], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        turned = Rotary.turn(torch.cat([q, k], dim=1), *(angles or self.rotary.angles(positions, x.dtype)))
        q, k = turned.split([c.num_attention_heads, c.num_key_value_heads], dim=1)
        return q, k, v

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return Rotary.turn(k, *self.rotary.angles(positions, x.dtype)), v

    def keys_values(self, embeddings: torch.Tensor, features: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V that positions add to a cache ([B, kv heads, T, D] each, at `positions` [T] or [B, T]): what
        `step` appends, without its attention and MLP. The head is one layer, so a position's K/V depend on its
        own inputs alone; a drafter catching its caches up on committed positions needs nothing else, and can
        take every sequence's new positions in one batch."""
        return self._kv(self._inputs(embeddings, features)[0], positions)

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.repeat_interleave(self.config.num_attention_heads // self.config.num_key_value_heads, dim=1)

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attended.shape
        hidden = residual + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        normed = self.post_norm(hidden)
        if self._fused_gate_up is not None:
            gate, up = self._fused_gate_up(normed).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(normed), self.up_proj(normed)
        return hidden + self.down_proj(F.silu(gate) * up)

    # -- whole sequences ---------------------------------------------------------------------------------------
    def forward(self, embeddings: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Causal pass over [B, T] positions: embeddings of x_{t+1} [B, T, H], features f_t [B, T, H] -> [B, T, H]."""
        return self.unrolled(embeddings, features, 1)[0]

    def unrolled(self, embeddings: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: outputs of drafting steps 1..`steps` at every position, each with the inputs and
        the attention context a drafter has at that step. Step 1 reads the target's features f_t; step j > 1
        reads the head's own step j-1 output at t-1 (position 0 keeps f_0: no chain reaches it). A query at
        position t in step j reads key position s from step 1 when t - s >= j - 1 (committed context, target
        features) and from step j - (t - s) otherwise (the drafts of this chain)."""
        k_steps, v_steps, outputs = [], [], []
        length = embeddings.shape[1]
        positions = torch.arange(length, device=embeddings.device)
        distance = positions[:, None] - positions[None, :]  # [T, T] t - s
        for j in range(1, steps + 1):
            if j > 1:
                features = torch.cat([features[:, :1], outputs[-1][:, :-1]], dim=1)
            x, residual = self._inputs(embeddings, features)
            q, k, v = self._qkv(x, positions)
            k_steps.append(self._expand(k))
            v_steps.append(self._expand(v))
            scores, values = [], []
            for i in range(1, j + 1):
                own = (distance == j - i) if i > 1 else (distance >= j - 1)
                allowed = own & (distance >= 0)
                s = (q @ k_steps[i - 1].transpose(-1, -2)) / math.sqrt(self.config.head_dim)  # [B, Hq, T, T]
                scores.append(s.masked_fill(~allowed, float("-inf")))
                values.append(v_steps[i - 1])
            weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)  # [B, Hq, T, i*T]
            attended = weights @ torch.cat(values, dim=2)
            outputs.append(self._finish(residual, attended))
        return outputs

    # -- incremental (a drafter) -------------------------------------------------------------------------------
    def step(self, embeddings: torch.Tensor, features: torch.Tensor, start: int,
             cache: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Feed positions start..start+T-1 of one sequence batch ([B, T, H] each) after `cache` (keys and values of
        positions 0..start-1, or None); returns the outputs and the grown cache."""
        x, residual = self._inputs(embeddings, features)
        positions = torch.arange(start, start + x.shape[1], device=x.device)
        q, k, v = self._qkv(x, positions)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        keys = torch.arange(k.shape[2], device=x.device)
        allowed = keys[None, :] <= positions[:, None]  # [T, total]
        attended = grouped_attention(q, k, v, allowed.expand(x.shape[0], *allowed.shape))
        return self._finish(residual, attended), (k, v)

    def step_rows(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                  cache: tuple[torch.Tensor, torch.Tensor], key_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """One position for each of B sequences at once (a step of a sampled tree's expansions, batched across
        sequences; chains write into a padded cache in place with step_tree instead): embeddings and features
        [B, 1, H] at `positions` [B], after `cache`, keys and values [B, kv heads, L, D] padded to one length,
        whose real columns `key_mask` [B, L] marks; returns the outputs [B, 1, H], the grown cache and mask. It is
        step_tree's one query a row, over the cache grown by a column."""
        keys, values = (F.pad(kv, (0, 0, 0, 1)) for kv in cache)
        key_mask = F.pad(key_mask, (0, 1), value=True)
        out = self.step_tree(embeddings, features, positions[:, None], keys, values, key_mask[:, None],
                             cache[0].shape[2])
        return out, (keys, values), key_mask

    def step_tree(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, slot: int,
                  angles: Angles | None = None) -> torch.Tensor:
        """T positions for each of B sequences at once, each its own query (a token tree's nodes of one depth, or
        a chain's next position): embeddings and features [B, T, H] at `positions` [B, T]. Their K/V are written
        into `keys` and `values` ([B, kv heads, W, D], in place) at columns slot..slot+T-1, and query t attends to
        the columns `visible[:, t]` ([B, T, W]) marks, which must include its own (a bool mask, or an additive one
        in the head's dtype: 0 where visible, -inf elsewhere); `angles` as _qkv's. Returns the outputs [B, T, H].
        Fixed shapes and no host reads, so a whole tree's or chain's steps can be captured as one graph."""
        x, residual = self._inputs(embeddings, features)
        q, k, v = self._qkv(x, positions, angles)
        keys[:, :, slot : slot + k.shape[2]] = k
        values[:, :, slot : slot + v.shape[2]] = v
        attended = grouped_attention(q, keys, values, visible)  # [B, Hq, T, D]
        return self._finish(residual, attended)

    # -- files -------------------------------------------------------------------------------------------------
    def save(self, folder: Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: (p.detach().to(torch.float16) if p.is_floating_point() else p).contiguous()
                   for name, p in self.state_dict().items()}, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps({**asdict(self.config), **(extra or {})}, indent=2) + "\n")

    @staticmethod
    def load(folder: Path, dtype: torch.dtype = torch.float32) -> EagleHead:
        from safetensors.torch import load_file

        fields = json.loads((folder / CONFIG_FILE).read_text())
        config = EagleConfig(**{k: fields[k] for k in EagleConfig.__dataclass_fields__ if k in fields})
        head = EagleHead(config)
        head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                              for k, v in load_file(str(folder / WEIGHTS_FILE)).items()})
        return head.to(dtype).eval()
