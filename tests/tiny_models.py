"""Tiny random causal LMs built in-process, so unit tests need no download."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96


def tiny_llama(seed: int = 0, vocab_size: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    return _sharpen(LlamaForCausalLM(config).eval())


def tiny_qwen2(seed: int = 0, vocab_size: int = VOCAB) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return _sharpen(Qwen2ForCausalLM(config).eval())


def smollm2_shaped(num_layers: int = 2, vocab_size: int = 2048, seed: int = 0) -> LlamaForCausalLM:
    """Random weights in SmolLM2-135M's layer shapes (hidden 576, MLP 1536, 9 query and 3 KV heads of 64), with
    `num_layers` of its 30 layers and a small vocabulary: every matmul of a layer has the real model's shape, so
    the CPU's kernels add in the orders they add in for the real model, at a fraction of its cost (the real model
    runs 30 such layers and a head of 49,152 rows)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=num_layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    return _sharpen(LlamaForCausalLM(config).eval())


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Random init gives near-uniform logits; scale the head so distributions have structure (some tokens
    likely, many not), which makes acceptance and sampling tests meaningful."""
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if not model.config.tie_word_embeddings else model.lm_head.weight.mul_(4.0)
    return model


def word_tokenizer(size: int):
    """A real fast tokenizer of `size` whole-word tokens "w0".."w{size-1}" (w0 also unknown), to save beside a tiny
    model so that a folder loads as a model users have would."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")


CHARS = "abcdefghijk"  # token i + 1 is CHARS[i]; token 0 is "</s>": matches tiny models of vocabulary 12


def tiny_char_tokenizer():
    """A real (byte-level BPE, no merges) fast tokenizer whose tokens are single letters, for grammar tests on
    the tiny models: llguidance builds its token masks from it exactly as from a real model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"</s>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.ByteLevel()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
