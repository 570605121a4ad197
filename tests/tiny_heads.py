"""Random EAGLE-1 and EAGLE-3 heads for tiny targets (tests/tiny_models.py), seeded: a head drafts poorly, but every path of
drafting and verifying runs, and losslessness must hold whatever it drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import torch

from services.modeling.eagle3_head import Eagle3Config, Eagle3Head
from services.modeling.eagle_head import EagleConfig, EagleHead


def eagle3_config(target_config, layers: Sequence[int] = (0, 1, -1), draft_vocab_size: int = 0,
                  norm_before_residual: bool = False) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=target_config.hidden_size, intermediate_size=target_config.intermediate_size,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        rms_norm_eps=target_config.rms_norm_eps, rope_theta=10000.0, vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab_size or target_config.vocab_size, target_hidden_size=target_config.hidden_size,
        target_layers=tuple(layers), norm_before_residual=norm_before_residual)


def random_eagle3_head(target_config, layers: Sequence[int] = (0, 1, -1), draft_vocab: Sequence[int] = (),
                       seed: int = 0, norm_before_residual: bool = False) -> Eagle3Head:
    """With `draft_vocab`, it drafts those target tokens only (its LM head's rows, in that order)."""
    torch.manual_seed(seed)
    head = Eagle3Head(eagle3_config(target_config, layers, len(draft_vocab), norm_before_residual)).eval()
    with torch.no_grad():
        for norm in (head.input_norm, head.hidden_norm, head.post_norm, head.norm):  # not all ones: they count
            norm.weight.uniform_(0.5, 1.5)
        head.lm_head.weight.mul_(8)  # a random head's logits are flat otherwise: make its drafts differ
    if draft_vocab:
        head.draft_vocab.copy_(torch.tensor(list(draft_vocab)))
    return head


def reduced_vocabulary_eagle_head(target, vocab_size: int, draft_vocab_size: int = 40, seed: int = 1) -> EagleHead:
    """A random EAGLE-1 head for `target` drafting a random `draft_vocab_size` of its tokens, its features scaled
    so that they count and chains differ per sequence."""
    torch.manual_seed(seed)
    config = EagleConfig(**{**asdict(EagleConfig.for_target(target.config)), "draft_vocab_size": draft_vocab_size})
    head = EagleHead(config).eval()
    head.draft_vocab.copy_(torch.randperm(vocab_size)[:draft_vocab_size].sort().values)
    with torch.no_grad():
        head.fc.weight.mul_(4)
    return head
