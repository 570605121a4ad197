"""Which of the target's hidden states a drafter reads, by layer, and how they are numbered.

Layer i (0 <= i < num_layers) is the residual stream entering decoder layer i, 0 being the token embeddings. That is
transformers' `output_hidden_states[i]` and the numbering of vLLM's EAGLE-3 `eagle_aux_hidden_state_layer_ids`, so a
published head's ids mean the same here. -1 (FINAL_LAYER) is the final, normed state, what EAGLE-1 reads
(transformers' `hidden_states[-1]`, which is also its index num_layers: that index is not used, -1 names it).

A drafter that reads several layers receives them concatenated along the feature axis, in the order it declared:
[n, len(layers) * hidden_size] for n committed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

FINAL_LAYER = -1
FINAL_ONLY = (FINAL_LAYER,)


def check_hidden_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The layers as a tuple, or ValueError naming the one a model of `num_layers` decoder layers lacks."""
    layers = tuple(int(i) for i in layers)
    if not layers:
        raise ValueError("hidden layers: at least one layer is needed")
    for i in layers:
        if i != FINAL_LAYER and not 0 <= i < num_layers:
            raise ValueError(f"hidden layer {i} does not exist: the target has {num_layers} decoder layers "
                             f"(0..{num_layers - 1}, or -1 for the final normed state)")
    return layers


def default_eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and a high layer, as vLLM picks for EAGLE-3 heads that name none: (2, L // 2, L - 3), a
    layer possibly twice on a shallow target, as there; below 4 layers (test models), (0, L // 2, L - 1)."""
    if num_layers >= 4:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, num_layers - 1)
