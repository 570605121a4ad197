"""Sibling linears (q/k/v, gate/up) as one matmul on an accelerator, with their weights still stored once.

On a GPU a small model's step is bound by kernel launches, not by its matmuls: SmolLM2-135M's forward launches
about 60 kernels a layer, three of them for q, k and v and two for gate and up, each reading the same input. One
launch for each group over the concatenated weights does the same arithmetic with three fewer launches a layer.
The concatenation is made once and each module's weight becomes a view into it, so the weights are not twice in
memory (the modules still run on their own where something else calls them, e.g. transformers' generate). On CPU
the kernel chooser's packed linears fuse the same groups (kernel_choice.py), so this is for other devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.modeling.cpu_linear import LinearFn


def fuse_in_place(modules: Sequence[torch.nn.Linear]) -> LinearFn:
    """One F.linear over the modules' concatenated weights (and biases), their outputs side by side in module
    order; each module's weight (and bias) is rebound to its rows of the concatenation. Modules fused before (a
    second runner on the same model) are fused over the concatenation they already share, not copied again."""
    weight = _already_side_by_side([m.weight.detach() for m in modules])
    if weight is None:
        weight = torch.cat([m.weight.detach() for m in modules])
    has_bias = modules[0].bias is not None
    bias = None
    if has_bias:
        bias = _already_side_by_side([m.bias.detach() for m in modules])
        if bias is None:
            bias = torch.cat([m.bias.detach() for m in modules])
    row = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight = torch.nn.Parameter(weight[row : row + rows], requires_grad=False)
        if has_bias:
            module.bias = torch.nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    return lambda x: torch.nn.functional.linear(x, weight, bias)


def _already_side_by_side(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor the parts are consecutive rows of, in order, when they are (what fuse_in_place left); else None."""
    first = parts[0]
    if not all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for p in parts):
        return None
    offset = first.storage_offset()
    for part in parts:
        if part.storage_offset() != offset:
            return None
        offset += part.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))
