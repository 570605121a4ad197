"""The target's processed distribution at every verified position: penalties, temperature, top-k, top-p, min-p.

All functions work on [B, P, V] logits (P = K+1 verified positions) with per-row parameters, batched, no host
syncs. Penalties at position j must see the draft tokens 1..j as if already generated: verifying position j
presumes every earlier draft token was accepted, and the non-speculative engine would have generated them.
"""

from __future__ import annotations

import torch

from services.verifier.sampling_batch import SamplingBatch


def draft_history_counts(draft_tokens: torch.Tensor, num_draft: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, K+1, V] counts of the draft tokens that precede each verified position (position 0 sees none)."""
    batch, k = draft_tokens.shape
    counts = torch.zeros(batch, k + 1, vocab_size, dtype=torch.float32, device=draft_tokens.device)
    if k == 0:
        return counts
    live = (torch.arange(k, device=draft_tokens.device)[None, :] < num_draft[:, None]).float()  # [B, K]
    one_hot = torch.zeros(batch, k, vocab_size, dtype=torch.float32, device=draft_tokens.device)
    one_hot.scatter_(2, draft_tokens[:, :, None], live[:, :, None])  # [B, K, V]
    counts[:, 1:] = one_hot.cumsum(dim=1)
    return counts


def apply_penalties(
    logits: torch.Tensor, batch: SamplingBatch, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> torch.Tensor:
    """OpenAI presence/frequency penalties on generated tokens; repetition penalty (CTRL / HF / vLLM rule:
    divide positive logits, multiply negative ones) on tokens of the prompt or the output."""
    counts = batch.output_counts[:, None, :] + draft_history_counts(draft_tokens, num_draft, logits.shape[-1])
    logits = logits - batch.frequency_penalty[:, None, None] * counts
    logits = logits - batch.presence_penalty[:, None, None] * (counts > 0).float()
    seen = (counts > 0) | batch.prompt_mask[:, None, :]  # [B, P, V]
    penalty = batch.repetition_penalty[:, None, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k and nucleus (top-p); one sort serves both."""
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)  # [B, P, V]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.any_top_k:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        remove |= rank[None, None, :] >= batch.top_k[:, None, None]
    if batch.any_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        remove |= mass_before >= batch.top_p[:, None, None]
    remove[..., 0] = False  # the best token always survives
    mask = torch.zeros_like(remove).scatter_(-1, sorted_index, remove)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    log_probs = logits.log_softmax(dim=-1)
    threshold = log_probs.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None, None]
    return logits.masked_fill(log_probs < threshold, float("-inf"))


def processed_log_probs(
    logits: torch.Tensor, batch: SamplingBatch, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> torch.Tensor:
    """[B, P, V] float32 log-probabilities of the distribution each row samples from.

    Greedy rows keep temperature 1 here (their pick is the argmax, which no filter below can remove), so their
    logprobs stay meaningful.
    """
    logits = logits.float()
    if batch.any_penalties:
        logits = apply_penalties(logits, batch, draft_tokens, num_draft)
    logits = logits / batch.temperature[:, None, None]
    if batch.any_top_k or batch.any_top_p:
        logits = apply_top_k_top_p(logits, batch)
    if batch.any_min_p:
        logits = apply_min_p(logits, batch)
    return logits.log_softmax(dim=-1)
