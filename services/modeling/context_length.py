"""How many tokens one request may hold when the user does not say: the model's whole context.

KV memory is a paged pool sized by a memory budget (kv_budget.py), so a long context no longer reserves memory
per sequence: one rule for the verifier, the drafters' models, the in-process engine and the bench."""

from __future__ import annotations

import torch

FALLBACK_CONTEXT = 2048  # a model whose config names no context length


def model_context_length(model: torch.nn.Module) -> int:
    return int(getattr(model.config, "max_position_embeddings", FALLBACK_CONTEXT) or FALLBACK_CONTEXT)


def resolve_max_model_len(model: torch.nn.Module, requested: int | None) -> int:
    """`requested` if the model has that many positions (ValueError otherwise); None: the model's context."""
    model_limit = model_context_length(model)
    if requested is None:
        return model_limit
    if requested > model_limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's context ({model_limit})")
    return requested
