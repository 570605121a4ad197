"""Which attention form a CUDA runner runs, measured at start-up for queries of one token a row (decode), of a few
(verification) and of many (prefill chunks, wide token trees), each at a few row counts and spans.

Why: on an H100 (torch 2.11, bf16, SmolLM2-135M; `python -m services.bench.step_host_profile`) a replayed step
graph of 2-9 tokens a row cost more than one of 1 token by an amount that grew with the span, not with the
width: one row, 2.00 against 3.01 ms over 2,048 positions and 2.25 against 4.10 over 4,096. A verify step paid
for its width in attention, and speculation lost there what its drafts won (ngram at 0.86-0.91x no
speculation on chat requests). scaled_dot_product_attention picks its kernel by what a call allows (a mask,
grouped heads, the query length), and which is fastest for which shape depends on the GPU and the torch build.
So the runner times the forms of attention.py (SDPA with grouped heads, SDPA with each KV head's query group folded
into the query length, the two matmuls) on its own head shapes, in CUDA graphs as its steps run, and keeps the
fastest for each class of query width at a few row counts and spans. The forms compute the same attention up to
the order of float additions; the batch-invariant mode's fixed shape is always the same, so it always runs the
same form. Measured on the H100 (stop 49), one form per width class was not enough: folded SDPA, chosen for
verifies by a near tie of probes at 1 and 16 rows, made a 64-row verify over 4,096 positions 34.5 ms where SDPA
took 39.4, but a 1-row one over 512 2.39 where it took 2.20; hence the grid (not yet measured on a GPU).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from services.modeling.attention import (
    Attention,
    additive_mask,
    attention_for,
    folded_sdpa_attention,
    grouped_attention,
    sdpa_attention,
)
from services.modeling.device_timing import graph_time_us

logger = logging.getLogger(__name__)

FORMS: Mapping[str, Attention] = {"SDPA": sdpa_attention, "folded SDPA": folded_sdpa_attention,
                                  "matmuls": grouped_attention}
DEFAULT_FORM = "SDPA"  # the form used before this was measured, where nothing else runs
VERIFY_WIDTH = 16  # queries of 2 to this many tokens a row are a verify's; wider ones a prefill chunk's
# (rows, tokens a row, span) timed for each class of query width. The fastest form depends on the rows and the span
# too (H100: for 5 tokens a row over 512 positions, SDPA 12.0 us at 1 row and 47.0 at 64, folded 19.0 and 30.6;
# over 4,096 at 1 row the matmuls 28.2 against SDPA's 62.4), so each class is timed on a grid of both.
PROBES: Mapping[str, tuple[tuple[int, int, int], ...]] = {
    "one token": tuple((rows, 1, span) for rows in (1, 8, 64) for span in (512, 4096)),
    "verify": tuple((rows, 5, span) for rows in (1, 8, 64) for span in (512, 4096)),
    "prefill": ((1, 256, 1024),),
}
AttentionInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]
Measure = Callable[[Attention, AttentionInputs], float]  # seconds or microseconds: only compared


def width_class(width: int) -> str:
    return "one token" if width == 1 else "verify" if width <= VERIFY_WIDTH else "prefill"


@dataclass(frozen=True)
class AttentionByShape:
    """Attention that runs, for a call's query width class, the form measured fastest at the probe nearest its
    rows and span (by ratio). A graph's shape is static, so the choice is made once at capture, not on the device.
    `chosen`: per class, ((rows, span), form) for each probe."""

    chosen: Mapping[str, tuple[tuple[tuple[int, int], Attention], ...]]
    description: str = ""
    # (rows, width, span) -> form, as found: an eager forward asks once a layer, thirty times for the same shape
    _found: dict[tuple[int, int, int], Attention] = field(default_factory=dict, repr=False, compare=False)

    def form_for(self, rows: int, width: int, span: int) -> Attention:
        form = self._found.get((rows, width, span))
        if form is None:
            def distance(probe: tuple[int, int]) -> float:
                return abs(math.log2(rows / probe[0])) + abs(math.log2(max(span, 1) / probe[1]))

            form = min(self.chosen[width_class(width)], key=lambda entry: distance(entry[0]))[1]
            self._found[(rows, width, span)] = form
        return form

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
        return self.form_for(q.shape[0], q.shape[1], keys.shape[2])(q, keys, values, mask, scale)


def probe_inputs(rows: int, width: int, span: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> AttentionInputs:
    """Inputs laid out as the runner's forward lays them out: K/V gathered into one [Hkv, rows * span, D] buffer
    seen as [Hkv, rows, span, D], each row's last `width` positions its queries, causal among themselves."""
    q = torch.randn(rows, width, num_heads, head_dim, device=device, dtype=dtype)
    keys, values = (torch.randn(num_kv_heads, rows * span, head_dim, device=device, dtype=dtype)
                    .view(num_kv_heads, rows, span, head_dim) for _ in range(2))
    fed = span - width + torch.arange(width, device=device)
    allowed = torch.arange(span, device=device)[None, :] <= fed[:, None]  # [width, span]
    return q, keys, values, additive_mask(allowed.expand(rows, width, span), dtype), head_dim ** -0.5


def measured_choice(inputs: Mapping[str, list[AttentionInputs]], measure: Measure) -> AttentionByShape:
    """The fastest form at each probe of each class of query width (inputs: PROBES' keys to their probes). A form
    that fails to run or to be captured there is no candidate; DEFAULT_FORM where none ran."""
    chosen, reports = {}, []
    for width_class_name, probes in inputs.items():
        entries = []
        for probe in probes:
            times = {}
            for name, form in FORMS.items():
                try:
                    times[name] = measure(form, probe)
                except RuntimeError as error:
                    logger.info("attention form %s did not run for %s queries: %s", name, width_class_name, error)
            best = min(times, key=times.__getitem__) if times else DEFAULT_FORM
            rows, span = probe[0].shape[0], probe[1].shape[2]
            entries.append(((rows, span), FORMS[best]))
            reports.append(f"{width_class_name} {rows}x{probe[0].shape[1]} over {span}: {best} ("
                           + ", ".join(f"{name} {value:.1f}" for name, value in times.items()) + ")")
        chosen[width_class_name] = tuple(entries)
    description = "; ".join(reports)
    logger.info("attention forms chosen by measurement (us): %s", description)
    return AttentionByShape(chosen, description)


def graph_measure(form: Attention, inputs: AttentionInputs) -> float:
    """Microseconds per call of `form` on `inputs`, replayed from a CUDA graph."""
    return graph_time_us(lambda: form(*inputs), repeats=20, replays=3)


@torch.inference_mode()
def choose_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                     measure: Measure = graph_measure) -> Attention:
    """On CUDA, the forms measured on these head shapes (a few ms at start-up); elsewhere attention_for's."""
    if device.type != "cuda":
        return attention_for(device)
    with torch.cuda.device(device):  # the timing's streams and graphs on the model's GPU, not the current one
        inputs = {width_class: [probe_inputs(*probe, num_heads, num_kv_heads, head_dim, device, dtype)
                                for probe in probes] for width_class, probes in PROBES.items()}
        return measured_choice(inputs, measure)
