"""An EAGLE-3 head: one decoder layer over [token embedding; fused feature of several target layers].

EAGLE-3 (Li et al., 2025) differs from EAGLE-1 (eagle_head.py) in what it reads and what it predicts:
- it reads the residual stream of a low, a middle and a high target layer (`target_layers`, numbered as
  services/modeling/hidden_layers.py and vLLM number them), concatenated and projected to the head's width by `fc`;
  a drafting step past the first reads the head's own previous output instead (already of that width);
- the decoder layer's attention reads [RMSNorm(embedding); RMSNorm(feature)] (2H wide) and adds to the feature
  (or to its normed form, `norm_before_residual`), not to a fused input;
- it predicts tokens directly: a final RMSNorm and its own LM head over a reduced draft vocabulary, whose row i is
  target token i + d2t[i] (`draft_vocab` holds those target ids), rather than the target's next feature.

The attention machinery (training-time test's `unrolled`, the drafter's `step`, `step_rows` and `step_tree`) is
EagleHead's: only the inputs, the feature fusion and the scoring are overridden. This layout is vLLM's
`Eagle3LlamaForCausalLM` (the layer and names of eagle3_head_files.py's published formats).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.modeling.eagle_head import DraftRows, EagleHead, HeadShape, RMSNorm, Rotary


@dataclass(frozen=True)
class Eagle3Config(HeadShape):
    draft_vocab_size: int
    target_hidden_size: int
    target_layers: tuple[int, ...]  # (): not named yet, vLLM's default three (eagle_head_files.fit_head_to_target)
    target: str = ""  # the target model it serves (a --model spec), where known
    norm_before_residual: bool = False
    head_dim_override: int = 0  # a published config's head_dim when it is not hidden_size // heads

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_attention_heads

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.target_layers

    @property
    def target_layer_width(self) -> int:
        return self.target_hidden_size

    @property
    def num_fused_layers(self) -> int:
        return len(self.target_layers) or 3


class Eagle3Head(EagleHead):
    predicts_target_features = False

    def __init__(self, config: Eagle3Config) -> None:
        nn.Module.__init__(self)
        self.config = config
        h, d, eps = config.hidden_size, config.head_dim, config.rms_norm_eps
        self.fc = nn.Linear(config.num_fused_layers * config.target_hidden_size, h, bias=False)
        self.input_norm = RMSNorm(h, eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, eps)  # on the feature
        self.q_proj = nn.Linear(2 * h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.rotary = Rotary(d, config.rope_theta)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: nn.Embedding | None = None  # its own embedding where a checkpoint ships one

    def target_features(self, states: torch.Tensor) -> torch.Tensor:
        """[..., layers * target H] target states, as the verifier sends them, fused to the head's width."""
        return self.fc(states)

    def draft_weight(self, lm_head_weight: torch.Tensor | None) -> torch.Tensor:
        """Its own LM head: the target's is not used (a drafter does not even read it)."""
        return self.lm_head.weight

    def draft_scores(self, outputs: torch.Tensor, rows: DraftRows) -> torch.Tensor:
        return rows.linear(self.norm(outputs))

    def _inputs(self, embeddings: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        return torch.cat([self.input_norm(embeddings), normed], dim=-1), residual

    def save(self, folder: Path, extra: dict | None = None) -> None:
        """In the speculators layout vLLM loads (eagle_head_files.save_speculators), fp16."""
        from services.modeling.eagle_head_files import save_speculators

        save_speculators(self, folder, extra)
