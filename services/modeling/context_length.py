"""How many positions each KV slot holds when the user does not say: the model's context, capped.

Why a cap: KV memory is allocated up front for every slot (max_num_seqs x max_model_len), and models that
declare 32k or 128k positions would take gigabytes per slot on a CPU machine. One rule for the verifier, the
in-process engine and the bench."""

from __future__ import annotations

import torch

DEFAULT_CONTEXT_CAP = 2048


def model_context_length(model: torch.nn.Module) -> int:
    return int(getattr(model.config, "max_position_embeddings", DEFAULT_CONTEXT_CAP) or DEFAULT_CONTEXT_CAP)


def resolve_max_model_len(model: torch.nn.Module, requested: int | None) -> int:
    """`requested` if the model has that many positions (ValueError otherwise); None: the model's context,
    capped at DEFAULT_CONTEXT_CAP."""
    model_limit = model_context_length(model)
    if requested is None:
        return min(model_limit, DEFAULT_CONTEXT_CAP)
    if requested > model_limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's context ({model_limit})")
    return requested
