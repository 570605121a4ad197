"""Counter-based random numbers keyed by (request seed, sequence position, stream, vocabulary index).

Why not one stateful torch.Generator per request: a generator's draws depend on how many numbers were taken
before, i.e. on K, on acceptance and on batch composition. Keying the noise by the *absolute position* of the
token being sampled instead makes the noise a pure function of the request, so

- a seeded request gives the same text whatever else is in the batch, and
- with a deterministic drafter, speculation on and off sample the *same* tokens (the coupled exponential race
  in rejection.py), which turns the lossless property into an exact, testable equality.

The hash is murmur3's 32-bit finaliser over int64 tensors (values kept in [0, 2**32) so signed overflow never
matters), computed batched on the logits' device: no Python loop over rows.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9

# Independent streams: the same (seed, position) must give unrelated numbers for different uses.
STREAM_SAMPLE = 0x1B873593
STREAM_ACCEPT = 0x5BD1E995
STREAM_RESIDUAL = 0x68E31DA4


def seed_to_int64(seed: int) -> int:
    """A request seed of the signed or unsigned 64-bit range as the int64 the engine's seed tensors hold.

    The seed's 64-bit pattern is kept and read as two's complement: a bijection, so distinct seeds stay distinct
    streams, and position_keys (which reads the low and high 32-bit words) sees the words of the seed itself.
    """
    pattern = seed & 0xFFFFFFFFFFFFFFFF
    return pattern - 2**64 if pattern >= 2**63 else pattern


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser; h holds int64 values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """A 32-bit key per (row, position). seeds [B] int64 (seed_to_int64), positions [B, P] int64."""
    seed_lo = (seeds & MASK32)[:, None]  # [B, 1]
    seed_hi = ((seeds >> 32) & MASK32)[:, None]
    key = fmix32(seed_lo ^ stream)
    key = fmix32(key ^ seed_hi)
    return fmix32(key ^ (positions & MASK32))  # [B, P]


def uniform(keys: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform (0, 1) float64 numbers [*keys.shape, width], one per key and index in [0, width)."""
    index = torch.arange(width, device=keys.device, dtype=torch.int64)
    h = fmix32((keys[..., None] + index * GOLDEN32) & MASK32)
    return (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)


def gumbel(keys: torch.Tensor, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gumbel(0, 1) noise: argmax(log p + g) is a sample from p (the exponential race, in log space)."""
    return (-torch.log(-torch.log(uniform(keys, width)))).to(dtype)
