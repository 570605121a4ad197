"""The EAGLE head's matmuls on CPU through the kernels measured fastest there (services/modeling/kernel_choice.py,
which the verifier's runner uses for the target): oneDNN's packed weights where they win, plain F.linear where
they do not.

Why: a draft step of the shipped SmolLM2 head on one row is a handful of small matmuls and the product with its
8,192 LM head rows, and on CPU these ran as plain products: `outputs @ rows.T` took 1,228 us at one row and 2,002
at eight, where oneDNN's packed weights take 189 and 443 (2-core EPYC, float32, warm cache), so a chain of 4 cost
about 16 ms an ask next to a 50 ms target step. On an accelerator the chain is one captured graph of the plain
products (eagle_head_graphs.py), so this is for CPU drafters only. Packed and plain agree to float32 rounding, so
a draft may differ in a near-tie of the head's scores; the verifier's output never depends on the drafts.
"""

from __future__ import annotations

import logging

from torch import nn

from services.modeling.cpu_linear import LinearFn
from services.modeling.eagle_head import DraftRows
from services.modeling.kernel_choice import KernelChooser

logger = logging.getLogger(__name__)


class ChosenLinear(nn.Module):
    """A linear module that runs the kernel chosen for its weight. It keeps the weight too, for code that reads a
    layer's dtype and device from it (eagle_trees.padded_caches)."""

    def __init__(self, kernel: LinearFn, weight: nn.Parameter) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = weight

    def forward(self, x):
        return self.kernel(x)


def use_chosen_kernels(head: nn.Module, rows: DraftRows, chooser: KernelChooser | None = None) -> DraftRows:
    """Replace the head's linear layers by the kernels `chooser` measures fastest for their shapes, and return the
    draft rows applied through theirs; where packing is unavailable (not a CPU tensor, a dtype oneDNN lacks) the
    layer or the rows stay as they were. An EAGLE-3 head's own LM head is applied through the rows, not as a
    module, so it is measured once, as the rows."""
    chooser = chooser or KernelChooser()
    linears = [(name, module) for name, module in head.named_modules()
               if isinstance(module, nn.Linear) and module.weight is not rows.weight]
    sites = [(name, [module.weight], [module.bias]) for name, module in linears]
    *kernels, rows_kernel = chooser.choose([*sites, ("draft rows", [rows.weight], [None])])
    for (name, module), kernel in zip(linears, kernels, strict=True):
        if kernel is not None:
            parent, _, attribute = name.rpartition(".")
            setattr(head.get_submodule(parent) if parent else head, attribute, ChosenLinear(kernel, module.weight))
    logger.info("EAGLE head kernels (measured in %.2f s): %s", chooser.measure_seconds, chooser.describe())
    return rows if rows_kernel is None else DraftRows(rows.weight, rows_kernel)
