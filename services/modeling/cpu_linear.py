"""Linear layers through oneDNN with weights reordered once at start-up (CPU only).

Why: on this class of CPU, torch's default fp32 path (MKL sgemm / sgemv) re-packs the weight on every call and
is slowest exactly where speculative decoding lives: a 2-core SmolLM2 measurement of all its linear layers gave
F.linear 31 ms at M=1 token and 63 ms at M=9 tokens, against 14 ms and 21 ms with oneDNN's pre-reordered weights
(same fp32 arithmetic, errors at fp32 rounding level). Verifying K+1 tokens then costs ~1.5x one token instead
of ~2x, which is what makes drafting pay off on CPU.

The ops are the ones torch's own CPU compiler (inductor freezing) uses; they are probed once, and anything
unsupported (other devices, dtypes or torch builds) returns None so callers keep the plain modules. Packed is
not faster everywhere (an AMX Xeon runs small shapes at one token faster through F.linear), so the runner
picks between the two per shape and token count by measuring at start-up (kernel_choice.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LinearFn = Callable[[torch.Tensor], torch.Tensor]


def packed_linear(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                  dtype: torch.dtype | None = None) -> LinearFn | None:
    """One linear over the concatenated weights ([sum out, in]) as a oneDNN-packed kernel, or None.

    dtype: the precision of the packed copy (default: the weights'). bfloat16 for float32 weights rounds the
    weights and each input to bfloat16, which oneDNN multiplies with float32 accumulation; the bias is added and
    the result returned in the input's dtype. Half the bytes a call reads, and a small model's linears at a few
    token rows are bound by those bytes. Only for drafters (kernel_choice.KernelChooser's allow_bf16): their
    numerics decide which drafts are proposed, never what the verifier outputs."""
    weight = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    rounded = dtype is not None and dtype != weight.dtype
    if rounded:
        weight = weight.to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        expected = torch.nn.functional.linear(probe, weight, None if rounded else bias)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None if rounded else bias, "none", [], "")
        if got.shape != expected.shape:
            return None
    except (RuntimeError, AttributeError, NotImplementedError):
        return None

    if rounded:
        del weight  # the packed copy is all a call reads; the closure must not keep the unpacked one alive

        def rounded_linear(x: torch.Tensor) -> torch.Tensor:
            out = torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], "").to(x.dtype)
            return out if bias is None else out + bias

        return rounded_linear

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return linear
