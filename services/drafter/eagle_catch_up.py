"""An EAGLE ask's catch-up as one computation: the newly committed positions of every sequence of a call, their head
features (an EAGLE-3 head's fc over the target's layers) and their K/V, in one batch; on an accelerator, one
captured graph per padded number of positions.

Why: on an H200 an EAGLE ask's chain was already one graph (~0.5 ms of GPU), but the ask took 1.5-3.7 ms with the
host work around it, 22-40 eager launches and 12-24 copies, most of them the catch-up (states moved and
converted, the fc, the embedding, the norm, the K/V projections and rotary, each its own launch). With a 2.6 ms
target step and ~1.75 tokens committed a step, an ask must cost a small part of a step for EAGLE to pay at all;
adaptive speculation turned EAGLE off there, rightly.

The body computes every new position's K/V, the last one's too (position n - 1, which a chain computes again as
its first step and the caller does not keep): one shape whatever the mix of sequences. A position's features and
K/V depend on its own inputs only (the head is one layer; no attention here), so padding positions, whatever they
hold, change nothing of the real ones. Positions are padded to a power of two from MIN_POSITIONS; a call of more
than MAX_POSITIONS (a new long prompt) runs eagerly. Graphs for every size are captured before serving
(capture_ahead), as the drafting graphs are (eagle_head_graphs.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.modeling.captured_shapes import CapturedShapes
from services.modeling.host_copies import pinned
from services.modeling.step_graphs import GraphBackend, TorchGraphs, power_of_two_at_least

logger = logging.getLogger(__name__)

MIN_POSITIONS = 8
MAX_POSITIONS = 512

# (token ids [N], target states [N, W] in the head's dtype, head positions [N]) -> (features [N, H], keys and
# values [N, kv heads, D], position-major as a sequence's head cache holds them): what catch_up_body computes
CatchUpBody = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def catch_up_body(head, embed: torch.nn.Module) -> CatchUpBody:
    """The head's features and K/V of positions t holding [embed(x_{t+1}); f_t] (EagleHead.keys_values)."""
    def body(ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor):
        features = head.target_features(states)
        keys, values = head.keys_values(embed(ids[None]), features[None], positions)
        return features, keys[0].transpose(0, 1).contiguous(), values[0].transpose(0, 1).contiguous()

    return body


@dataclass
class _Captured:
    replay: Callable[[], None]
    indices: torch.Tensor  # [2, N] int64: token ids, positions
    states: torch.Tensor  # [N, W]
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class CatchUpGraphs:
    def __init__(self, body: CatchUpBody, backend: GraphBackend, state_width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self._body, self._backend = body, backend
        self._width, self._dtype, self.device = state_width, dtype, device
        self._captures: CapturedShapes[_Captured] = CapturedShapes("the EAGLE catch-up (positions)")
        self._graphs = self._captures.graphs  # by padded number of positions

    @classmethod
    def for_device(cls, body: CatchUpBody, state_width: int, dtype: torch.dtype,
                   device: torch.device) -> CatchUpGraphs | None:
        """None where the catch-up runs eagerly: on CPU or without a graph API."""
        backend = TorchGraphs.for_device(device)
        return None if backend is None else cls(body, backend, state_width, dtype, device)

    @staticmethod
    def size_for(positions: int) -> int | None:
        """The padded number of positions of the graph that takes a call of `positions`; None: eagerly."""
        size = max(MIN_POSITIONS, power_of_two_at_least(positions))
        return size if size <= MAX_POSITIONS else None

    def capture_ahead(self, max_positions: int = MAX_POSITIONS) -> int:
        """Capture now every size up to `max_positions` not captured yet; returns how many were."""
        sizes = []
        size = MIN_POSITIONS
        while size <= min(max_positions, MAX_POSITIONS):
            sizes.append(size)
            size *= 2
        sizes = [s for s in sizes if not self._captures.known(s)]
        started = time.perf_counter()
        captured = sum(self._captures.get(s, lambda s=s: self._capture(s), ahead=True) is not None for s in sizes)
        if sizes:
            logger.info("captured %d of %d EAGLE catch-up graphs ahead (up to %d positions) in %.1f s", captured,
                        len(sizes), sizes[-1], time.perf_counter() - started)
        return captured

    def run(self, ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor):
        """The body's outputs for `ids` and `positions` ([N] int64, on the host) and `states` ([N, W], anywhere),
        sliced to N (views of the graph's outputs: the next replay overwrites them); None: run it eagerly."""
        count = ids.shape[0]
        size = self.size_for(count)
        captured = None if size is None else self._captures.get(size, lambda: self._capture(size))
        if captured is None:
            return None
        indices = torch.zeros(2, size, dtype=torch.int64)
        indices[0, :count], indices[1, :count] = ids, positions
        captured.indices.copy_(pinned(indices), non_blocking=True)
        # from the host in the head's dtype already: a copy that converts too goes through a pageable temporary,
        # which makes the host wait for the device
        source = states if states.device.type != "cpu" else pinned(states.to(self._dtype))
        captured.states[:count].copy_(source, non_blocking=True)  # rows past count keep what they held
        captured.replay()
        features, keys, values = captured.outputs
        return features[:count], keys[:count], values[:count]

    @property
    def capture_seconds(self) -> float:
        return self._captures.seconds

    def _capture(self, size: int) -> _Captured:
        """The body captured over zeroed buffers of `size` positions (raises where the platform refuses)."""
        indices = torch.zeros(2, size, dtype=torch.int64, device=self.device)
        states = torch.zeros(size, self._width, dtype=self._dtype, device=self.device)
        replay, outputs = self._backend.capture(lambda: self._body(indices[0], states, indices[1]))
        return _Captured(replay, indices, states, outputs)

    def __len__(self) -> int:
        return len(self._captures)
