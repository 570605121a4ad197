"""What this CPU's oneDNN offers, for the tests of kernels that exist only where it offers them.

oneDNN multiplies bfloat16 only on CPUs with AVX-512 (AVX512-BF16 or AMX at best); on an AVX2-only CPU (an AMD
EPYC VM seen here) it has no bf16 linear, `packed_linear(..., torch.bfloat16)` is None and the drafters' kernel
choice never offers the bf16 copy. Tests of that copy itself need such a CPU and say so when skipped; the tests of
the choice check what is offered against this CPU's answer, so they run everywhere."""

from __future__ import annotations

import pytest
import torch


def bf16_linear_supported() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


needs_bf16_linear = pytest.mark.skipif(
    not bf16_linear_supported(),
    reason="needs a CPU where oneDNN multiplies bfloat16 (AVX-512): this one has no bf16 linear, so the drafters' "
           "bf16 kernel is never a candidate on it",
)
