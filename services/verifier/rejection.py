"""Batched lossless verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

Rows carry a variable number of draft tokens (K_b >= 0, padded to K). For every row the target distribution is
known at K_b+1 positions: p_1..p_{K_b} for the drafts and p_{K_b+1} for the bonus token.

- Deterministic drafts (ngram, suffix, argmax drafting; q is one-hot). Draw y_j = argmax(log p_j + g_j) with
  Gumbel noise g_j keyed by the absolute position (random_streams.py) and accept x_j iff y_j == x_j; the first
  mismatch emits y_j. P(accept) = p_j(x_j) and, given a rejection, y_j ~ p_j with x_j removed and renormalised:
  exactly the rule of docs/architecture.md. Because g_j depends only on (seed, position), the emitted tokens are
  the very tokens the engine samples with speculation off. Greedy rows are the same code with g = 0.
- Drafts sampled from q (q sent). Accept x_j iff u_j * q_j(x_j) < p_j(x_j) (probability min(1, p/q)); the first
  rejection emits a sample of norm(max(0, p_j - q_j)); greedy rows ignore q (argmax acceptance is exact).
- When all K_b drafts are accepted, the bonus token y_{K_b+1} ~ p_{K_b+1} is emitted.

No Python loop over rows and a single host transfer at the end (done by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.sampling_rules import LOGPROB_FLOOR
from services.verifier import random_streams
from services.verifier.logits_processing import processed_log_probs
from services.verifier.sampling_batch import SamplingBatch


@dataclass(frozen=True)
class VerifyOutput:
    tokens: torch.Tensor  # [B, K+1] int64; row b emits tokens[b, : num_accepted[b] + 1]
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens (0..K_b)
    logprobs: torch.Tensor  # [B, K+1] float32, log p of each emitted token under the processed distribution
    top_logprobs: torch.Tensor | None  # [B, K+1, n] float32
    top_token_ids: torch.Tensor | None  # [B, K+1, n] int64
    log_probs: torch.Tensor  # [B, K+1, V] float32, the processed distributions (a q-tree's walk reads them)


def verify(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    positions: torch.Tensor,
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None = None,
    has_draft_probs: torch.Tensor | None = None,
) -> VerifyOutput:
    """Accept or reject each row's drafts and emit 1..K_b+1 tokens per row.

    logits       [B, K+1, V] target logits at the verified positions (row b valid up to K_b+1)
    draft_tokens [B, K] int64 (padding arbitrary but < V)
    num_draft    [B] int64, K_b
    positions    [B] int64, the sequence index the first emitted token of each row will take
    draft_probs  [B, K, V] q of each drafted position, only for rows with has_draft_probs [B] bool
    """
    batch_size, num_positions, vocab = logits.shape
    k = num_positions - 1
    device = logits.device
    log_p = processed_log_probs(logits, batch, draft_tokens, num_draft)  # [B, K+1, V]

    offsets = torch.arange(num_positions, device=device)
    token_positions = positions[:, None] + offsets[None, :]  # [B, K+1]
    sampled = coupled_samples(log_p, token_positions, batch)  # [B, K+1]: y_j, the token speculation-off picks here

    drafted = offsets[None, :k] < num_draft[:, None]  # [B, K]
    accept = sampled[:, :k] == draft_tokens  # coupled rule for deterministic drafts and greedy rows
    correction = sampled

    use_q = None
    if draft_probs is not None and has_draft_probs is not None and batch.any_sampled:
        use_q = has_draft_probs & ~batch.greedy  # [B]
        p_draft = log_p[:, :k].gather(-1, draft_tokens[:, :, None]).squeeze(-1).exp()  # [B, K]
        q_draft = draft_probs.gather(-1, draft_tokens[:, :, None]).squeeze(-1).float()  # [B, K]
        u = random_streams.uniform(
            random_streams.position_keys(batch.seeds, token_positions[:, :k], random_streams.STREAM_ACCEPT), 1
        ).squeeze(-1)  # [B, K]
        accept_q = u * q_draft < p_draft
        accept = torch.where(use_q[:, None], accept_q, accept)

        residual = (log_p[:, :k].exp() - draft_probs.float()).clamp_min(0.0)  # [B, K, V]
        # If p <= q everywhere, rejection has probability 0; fall back to p to stay well defined.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, log_p[:, :k].exp())
        residual_noise = random_streams.gumbel(
            random_streams.position_keys(batch.seeds, token_positions[:, :k], random_streams.STREAM_RESIDUAL),
            vocab,
        )
        residual_sample = (residual.log() + residual_noise).argmax(dim=-1)  # [B, K]
        correction = sampled.clone()
        correction[:, :k] = torch.where(use_q[:, None] & drafted, residual_sample, sampled[:, :k])

    num_accepted = (accept & drafted).long().cumprod(dim=1).sum(dim=1)  # [B]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_zeros(batch_size, 1)], dim=1)  # [B, K+1]
    tokens = torch.where(offsets[None, :] < num_accepted[:, None], padded_drafts, correction)  # [B, K+1]
    logprobs = log_p.gather(-1, tokens[:, :, None]).squeeze(-1).clamp_min(LOGPROB_FLOOR)

    top_logprobs = top_ids = None
    if batch.num_logprobs > 0:
        top_logprobs, top_ids = log_p.topk(batch.num_logprobs, dim=-1)
        top_logprobs = top_logprobs.clamp_min(LOGPROB_FLOOR)
    return VerifyOutput(tokens, num_accepted, logprobs, top_logprobs, top_ids, log_p)


def coupled_samples(log_p: torch.Tensor, token_positions: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, P] int64: at each verified position the token speculation-off samples at `token_positions` [B, P], the
    argmax of log p [B, P, V] plus Gumbel noise keyed by (seed, position); greedy rows' argmax of log p."""
    if not batch.any_sampled:
        return log_p.argmax(dim=-1)
    noise = random_streams.gumbel(
        random_streams.position_keys(batch.seeds, token_positions, random_streams.STREAM_SAMPLE), log_p.shape[-1]
    )
    return torch.where(batch.greedy[:, None, None], log_p, log_p + noise).argmax(dim=-1)
