"""Prompt logprobs (SamplingParams.prompt_logprobs): how likely the target finds each prompt token given the
tokens before it, as vLLM's prompt_logprobs and OpenAI's `echo` + `logprobs` report them (lm-evaluation-harness
scores loglikelihoods this way).

The distribution is the target's raw one, log_softmax of its logits: no logit bias, penalties, temperature or
filters, which shape sampling, not scoring. A prefill chunk of n tokens that asks gives logits for all its n
positions (other chunks keep asking for the last one only); position j scores the prompt token after it. Only
`SCORING_BLOCK` positions are normalised at a time, so beyond the chunk's logits ([n, V], n bounded by the
step's token budget) scoring holds [SCORING_BLOCK, V] floats at most.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.modeling.host_copies import to_device
from services.verifier.outputs import TokenLogprob

SCORING_BLOCK = 128  # positions log-softmaxed at once


def score_positions(logits: torch.Tensor, next_tokens: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """logits: [n, V] raw target logits of n consecutive positions; next_tokens: the m <= n tokens that follow
    the first m of them. Returns m entries: each token's logprob, its rank (1 + the number of tokens at least as
    likely, itself excluded) and the `num_top` most likely tokens, best first. The chosen token's logprob and the
    alternatives' come from the same tensor, so a token that is the argmax reports exactly the top logprob
    (lm-evaluation-harness's greedy check compares them with ==)."""
    count = len(next_tokens)
    if count > logits.shape[0]:
        raise ValueError(f"{count} tokens to score but logits for {logits.shape[0]} positions")
    targets = to_device(torch.tensor(list(next_tokens), dtype=torch.int64), logits.device)  # [m]
    entries: list[TokenLogprob] = []
    for start in range(0, count, SCORING_BLOCK):
        end = min(start + SCORING_BLOCK, count)
        logprobs = torch.log_softmax(logits[start:end].float(), dim=-1)  # [b, V]
        chosen = logprobs.gather(1, targets[start:end, None])  # [b, 1]
        ranks = (logprobs >= chosen).sum(dim=-1)  # [b]; the token itself counts, so rank >= 1
        top_ids: list[list[int]] = [[] for _ in range(end - start)]
        top_lps: list[list[float]] = [[] for _ in range(end - start)]
        if num_top:
            values, indices = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # [b, top]
            top_ids, top_lps = indices.tolist(), values.tolist()
        for j, (lp, rank) in enumerate(zip(chosen[:, 0].tolist(), ranks.tolist(), strict=True)):
            entries.append(TokenLogprob(
                token_id=int(next_tokens[start + j]),
                logprob=lp,
                top=tuple(zip(top_ids[j], top_lps[j], strict=True)),
                rank=rank,
            ))
    return entries
