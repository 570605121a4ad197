"""The EAGLE head: its training-time unrolling is exactly what a drafter computes step by step with its KV cache,
and it survives a save/load round trip."""

from __future__ import annotations

import copy

import torch

from services.modeling.eagle_head import EagleConfig, EagleHead

CONFIG = EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50)


def head() -> EagleHead:
    torch.manual_seed(0)
    return EagleHead(CONFIG).eval()


def test_unrolled_steps_equal_the_drafting_chain():
    model = head()
    length, steps = 10, 4
    emb = torch.randn(1, length, 32)
    feats = torch.randn(1, length, 32)
    with torch.no_grad():
        outputs = model.unrolled(emb, feats, steps)
        for n in range(1, length - steps + 1):  # the committed context ends at position n - 1
            _, cache = model.step(emb[:, : n - 1], feats[:, : n - 1], 0, None) if n > 1 else (None, None)
            feature = feats[:, n - 1 : n]
            for j in range(1, steps + 1):
                t = n - 1 + (j - 1)
                out, cache = model.step(emb[:, t : t + 1], feature, t, cache)
                assert torch.allclose(out[0, 0], outputs[j - 1][0, t], atol=1e-5), (n, j)
                feature = out


def test_step_one_is_the_plain_causal_forward_and_save_load(tmp_path):
    model = head()
    emb, feats = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        whole = model(emb, feats)
        first, cache = model.step(emb[:, :3], feats[:, :3], 0, None)
        rest, _ = model.step(emb[:, 3:], feats[:, 3:], 3, cache)
        assert torch.allclose(torch.cat([first, rest], 1), whole, atol=1e-5)
        model.save(tmp_path, {"steps_trained": 3})
        loaded = EagleHead.load(tmp_path)
        assert torch.allclose(loaded(emb, feats), whole, atol=2e-2)  # fp16 on disk


def test_a_batched_chain_step_equals_each_sequence_on_its_own():
    """step_rows (the drafter's chains batched across sequences, caches padded to one length) gives each row what
    `step` gives that sequence alone, at its own position, whatever the other rows' lengths."""
    model = head()
    lengths = [5, 0, 2]
    caches, singles = [], []
    with torch.no_grad():
        for length in lengths:
            if length:
                _, cache = model.step(torch.randn(1, length, 32), torch.randn(1, length, 32), 0, None)
            else:
                cache = (torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))
            caches.append(cache)
        emb, feats = torch.randn(2, 3, 1, 32), torch.randn(3, 1, 32)  # [chain step, row, 1, H]
        for b, length in enumerate(lengths):  # two chain steps alone
            out, cache = model.step(emb[0, b : b + 1], feats[b : b + 1], length, caches[b] if length else None)
            out2, _ = model.step(emb[1, b : b + 1], out, length + 1, cache)
            singles.append((out[0], out2[0]))
        width = max(lengths)
        keys, values = torch.zeros(3, 2, width, 8), torch.zeros(3, 2, width, 8)
        for b, (k, v) in enumerate(caches):
            keys[b, :, : k.shape[2]], values[b, :, : v.shape[2]] = k[0], v[0]
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        positions = torch.tensor(lengths)
        out, cache, mask = model.step_rows(emb[0], feats, positions, (keys, values), mask)
        out2, _, _ = model.step_rows(emb[1], out, positions + 1, cache, mask)
    for b in range(3):
        assert torch.allclose(out[b], singles[b][0], atol=1e-5) and torch.allclose(out2[b], singles[b][1], atol=1e-5)


def test_grouped_attention_is_each_query_head_reading_its_own_kv_head():
    """The folded SDPA call against attention written out head by head and query by query: query head h reads KV
    head h // (Hq / Hkv), and query t only the columns its own row of `visible` marks (a fold that paired heads or
    mask rows otherwise fails)."""
    from services.modeling.eagle_head import grouped_attention

    generator = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, dim, length = 2, 6, 2, 8, 7
    for queries in (1, 3):
        q = torch.randn(batch, heads, queries, dim, generator=generator)
        keys, values = (torch.randn(batch, kv_heads, length, dim, generator=generator) for _ in range(2))
        visible = torch.rand(batch, queries, length, generator=generator) < 0.6
        visible[..., queries - 1 :: 3] = True  # every query sees a column
        out = grouped_attention(q, keys, values, visible)
        for b in range(batch):
            for h in range(heads):
                kv = h // (heads // kv_heads)
                for t in range(queries):
                    seen = visible[b, t]
                    weights = torch.softmax(keys[b, kv, seen] @ q[b, h, t] / dim**0.5, dim=0)
                    assert torch.allclose(out[b, h, t], weights @ values[b, kv, seen], atol=1e-5), (queries, b, h, t)


def test_rotary_turns_queries_as_transformers_llama_does():
    """Rotary against transformers' own RoPE (LlamaRotaryEmbedding, apply_rotary_pos_emb), at positions shared by the
    rows and at each row's own, in float32 and bfloat16."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from services.modeling.eagle_head import Rotary

    dim, theta = 16, 500000.0
    config = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, rope_theta=theta)
    reference = LlamaRotaryEmbedding(config)
    rotary = Rotary(dim, theta)
    x = torch.randn(2, 4, 3, dim, generator=torch.Generator().manual_seed(2))
    for positions in (torch.tensor([5, 6, 7]), torch.tensor([[0, 1, 2], [900, 901, 4000]])):
        position_ids = positions.expand(2, 3)
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = reference(x.to(dtype), position_ids)
            expected, _ = apply_rotary_pos_emb(x.to(dtype), x.to(dtype), cos, sin)
            turned = Rotary.turn(x.to(dtype), *rotary.angles(positions, dtype))
            assert torch.allclose(turned.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_fused_sibling_linears_step_as_the_modules_do():
    """q/k/v and gate/up fused into one matmul each (what a drafter on an accelerator runs) give the same outputs
    and K/V as the separate modules, for an EAGLE-1 head and an EAGLE-3 head, and hold no weight twice."""
    from tests.tiny_heads import random_eagle3_head
    from tests.tiny_models import tiny_llama

    for plain in (head(), random_eagle3_head(tiny_llama(seed=5).config).eval()):
        fused = copy.deepcopy(plain)
        fused.fuse_sibling_linears()
        assert fused.q_proj.weight.untyped_storage().data_ptr() == fused.v_proj.weight.untyped_storage().data_ptr()
        config, generator = plain.config, torch.Generator().manual_seed(3)
        emb = torch.randn(2, 3, config.hidden_size, generator=generator)
        states = torch.randn(2, 3, config.target_layer_width * len(config.hidden_layers), generator=generator)
        with torch.no_grad():
            out, (k, v) = plain.step(emb, plain.target_features(states), 0, None)
            out2, (k2, v2) = fused.step(emb, fused.target_features(states), 0, None)
        assert torch.allclose(out, out2, atol=1e-5) and torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2)
