"""Per-row sampling parameters of one engine step, as tensors (built once per step on the host)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.modeling.host_copies import to_device
from services.verifier.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Sampling parameters for B rows. The `any_*` flags are host booleans derived from the parameters (not
    from tensors), so skipping unused work never needs a device sync."""

    temperature: torch.Tensor  # [B] float32; greedy rows hold 1.0 (their distribution is untempered)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64; disabled rows hold the vocabulary size
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    output_counts: torch.Tensor | None  # [B, V] float32: generated-token counts (penalties only)
    prompt_mask: torch.Tensor | None  # [B, V] bool: tokens seen in the prompt (repetition penalty only)
    any_sampled: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool
    num_logprobs: int  # the largest top-n asked in the batch (0 when none), at most the vocabulary

    @staticmethod
    def build(
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        vocab_size: int,
        device: torch.device,
        output_counts: Sequence[torch.Tensor | None] | None = None,
        prompt_masks: Sequence[torch.Tensor | None] | None = None,
    ) -> SamplingBatch:
        """output_counts / prompt_masks: per row a [V] tensor, or None for rows without penalties."""
        any_penalties = any(p.uses_penalties for p in params)
        counts = masks = None
        if any_penalties:
            zeros = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            no_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            rows = output_counts or [None] * len(params)
            counts = torch.stack([c if c is not None else zeros for c in rows])
            rows = prompt_masks or [None] * len(params)
            masks = torch.stack([m if m is not None else no_prompt for m in rows])
        # Every per-row parameter in two host-to-device copies, neither waited for (host_copies.py)
        floats = torch.tensor([[1.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params],
                               [p.min_p for p in params], [p.presence_penalty for p in params],
                               [p.frequency_penalty for p in params], [p.repetition_penalty for p in params]],
                              dtype=torch.float32)
        ints = torch.tensor([[min(p.top_k, vocab_size) if p.top_k_enabled else vocab_size for p in params],
                             list(seeds), [p.greedy for p in params]], dtype=torch.int64)
        floats, ints = to_device(floats, device), to_device(ints, device)
        return SamplingBatch(
            temperature=floats[0],
            greedy=ints[2].bool(),
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            presence_penalty=floats[3],
            frequency_penalty=floats[4],
            repetition_penalty=floats[5],
            seeds=ints[1],
            output_counts=counts,
            prompt_mask=masks,
            any_sampled=any(not p.greedy for p in params),
            any_top_k=any(p.top_k_filters(vocab_size) for p in params),
            any_top_p=any(p.top_p_filters for p in params),
            any_min_p=any(p.min_p_filters for p in params),
            any_penalties=any_penalties,
            num_logprobs=min(vocab_size, max((p.logprobs or 0 for p in params), default=0)),
        )

    @staticmethod
    def temperature_only(temperature: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, vocab_size: int,
                         any_sampled: bool) -> SamplingBatch:
        """Rows sampled by temperature and seed alone, from tensors already on the device (a captured verification,
        captured_verify.py): every filter and penalty off, their tensors neutral."""
        ones, zeros = torch.ones_like(temperature), torch.zeros_like(temperature)
        return SamplingBatch(
            temperature=temperature, greedy=greedy, top_k=torch.full_like(seeds, vocab_size), top_p=ones, min_p=zeros,
            presence_penalty=zeros, frequency_penalty=zeros, repetition_penalty=ones, seeds=seeds, output_counts=None,
            prompt_mask=None, any_sampled=any_sampled, any_top_k=False, any_top_p=False, any_min_p=False,
            any_penalties=False, num_logprobs=0)
