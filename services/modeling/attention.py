"""Attention over the paged KV cache for a batch of rows with per-row masks and grouped-query heads.

On CPU, written as two matmuls instead of calling scaled_dot_product_attention: torch's flash kernel with an
explicit mask and GQA took ~6.6 ms per layer for one decode token over 600 cached positions (about 90% of a
SmolLM2 step), while the matmul form reads each cached K/V once, without repeating KV heads, in a fraction of
that. Query lengths here are small (K+1 for verification, a bounded chunk for prefill), so the [L, T] score
matrix is cheap. On CUDA the other way round: SDPA's fused kernel (with enable_gqa) took an H100 8.5 us a layer
for one decode token over 512 positions against the matmuls' 16.4, and 13.8 against 23.7 for 8 rows of 5 tokens
(bf16, device time from a CUDA graph, `python -m services.bench.step_host_profile`); the two differ by rounding
only (at most 5e-3 in bf16). attention_for picks by device; an NPU keeps the matmuls until measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L, T] bool (True = may attend) -> [B, 1, L, T] with 0 / -inf, broadcastable over [Hkv, B, G, L, T]."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, L, Hq, D]; keys/values [Hkv, B, T, D] (a view of the paged pool, or the batch's gathered
    positions); mask [B, 1, L, T] additive.

    Returns [B, L, Hq * D]. Query head h attends with KV head h // (Hq / Hkv), as transformers' repeat_kv does.
    KV heads lead so that both the pool's view and its gather are contiguous batches of [T, D] matrices.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    groups = num_heads // num_kv_heads
    q = q.view(batch, length, num_kv_heads, groups, head_dim).permute(2, 0, 3, 1, 4)  # [Hkv, B, G, L, D]
    q = q.reshape(num_kv_heads, batch, groups * length, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [Hkv, B, G*L, T]
    scores = scores.view(num_kv_heads, batch, groups, length, -1) + mask  # [Hkv, B, G, L, T]
    probs = scores.softmax(dim=-1).to(values.dtype).view(num_kv_heads, batch, groups * length, -1)
    out = torch.matmul(probs, values)  # [Hkv, B, G*L, D]
    out = out.view(num_kv_heads, batch, groups, length, head_dim).permute(1, 3, 0, 2, 4)  # [B, L, Hkv, G, D]
    return out.reshape(batch, length, num_heads * head_dim)


def sdpa_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """grouped_attention's contract through torch's scaled_dot_product_attention: one fused kernel, KV heads shared
    by their query groups (enable_gqa) without being repeated. The mask must be in q's dtype."""
    batch, length, num_heads, head_dim = q.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, Hq, L, D]
    return out.transpose(1, 2).reshape(batch, length, num_heads * head_dim)


def folded_sdpa_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """grouped_attention's contract through scaled_dot_product_attention without enable_gqa: each KV head's query
    group is folded into the query length ([B, Hkv, G * L, D] against [B, Hkv, T, D]), as the matmuls fold it, so
    the call is plain multi-head attention with an additive mask, which SDPA may serve with other fused kernels
    than a grouped call with a mask (attention_choice.py measures which is faster where it runs)."""
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    groups = num_heads // num_kv_heads
    folded = q.view(batch, length, num_kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, L, D]
    folded = folded.reshape(batch, num_kv_heads, groups * length, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask.repeat(1, 1, groups, 1), scale=scale
    )  # [B, Hkv, G * L, D]; the mask's query index g * L + l is mask[l], as the fold's
    out = out.view(batch, num_kv_heads, groups, length, head_dim).permute(0, 3, 1, 2, 4)  # [B, L, Hkv, G, D]
    return out.reshape(batch, length, num_heads * head_dim)


def attention_for(device: torch.device) -> Attention:
    """The form used until one is measured: SDPA on CUDA, the matmuls elsewhere (an NPU keeps the matmuls until
    measured). A CUDA runner measures its forms at start-up instead (attention_choice.py)."""
    return sdpa_attention if device.type == "cuda" else grouped_attention
