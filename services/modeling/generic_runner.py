"""Fallback runner for any transformers causal LM: one sequence at a time, a DynamicCache per sequence.

Slower than the llama-family runner (no batching across rows) but it lets every architecture transformers can
run serve, speculation included: rollback is DynamicCache.crop. Its caches grow as transformers grows them, with
no pool and no prefix caching: it reports every KV need as met.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from transformers import DynamicCache

from services.modeling.block_pool import PrefixCacheStats
from services.modeling.hidden_layers import FINAL_ONLY, check_hidden_layers
from services.modeling.runner import ForwardOutput, KVUsage, RowInput


class GenericRunner:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._caches: dict[Hashable, DynamicCache] = {}
        self._lengths: dict[Hashable, int] = {}
        self._prefix_stats = PrefixCacheStats()
        self.hidden_layers = FINAL_ONLY  # the states forward returns (hidden_layers.py)

    def serve_hidden_layers(self, layers: Sequence[int]) -> None:
        """Return the states of these target layers, concatenated, as ForwardOutput.hidden_states."""
        self.hidden_layers = check_hidden_layers(layers, int(self.model.config.num_hidden_layers))

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        if seq_id in self._caches:
            raise ValueError(f"sequence {seq_id!r} already added")
        if len(self._caches) >= self.max_num_seqs:
            raise RuntimeError(f"no free slot (max_num_seqs={self.max_num_seqs})")
        self._caches[seq_id] = DynamicCache(config=self.model.config)
        self._lengths[seq_id] = 0
        self._prefix_stats.queries += len(prompt)
        return 0

    def remove_sequence(self, seq_id: Hashable) -> None:
        del self._caches[seq_id]
        del self._lengths[seq_id]

    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self._caches)

    def length(self, seq_id: Hashable) -> int:
        return self._lengths[seq_id]

    def truncate(self, seq_id: Hashable, length: int) -> None:
        if length > self._lengths[seq_id]:
            raise ValueError("truncate can only shorten a sequence")
        if length < self._lengths[seq_id]:
            self._caches[seq_id].crop(length - self._lengths[seq_id])  # negative: tokens to drop
        self._lengths[seq_id] = length

    def kv_blocks_needed(self, seq_id: Hashable | None, length: int) -> int:
        return 0

    def kv_blocks_available(self) -> int:
        return 0

    def reserve(self, seq_id: Hashable, length: int) -> None:
        pass

    @property
    def kv_usage(self) -> KVUsage:
        return KVUsage(0, 0, 0, 1, self._prefix_stats)

    def capture_graphs(self, max_width: int, tails: Sequence = ()) -> int:
        return 0  # transformers' own forward, eagerly

    @torch.inference_mode()
    def forward(self, rows: Sequence[RowInput]) -> ForwardOutput:
        logits, hidden = [], []
        for row in rows:
            if row.parents is not None:
                raise ValueError("the generic transformers runner feeds chains only (no supports_trees)")
            start, n = self._lengths[row.seq_id], len(row.token_ids)
            if start + n > self.max_model_len:
                raise ValueError(f"row {row.seq_id!r} would exceed max_model_len={self.max_model_len}")
            out = self.model(
                input_ids=torch.tensor([list(row.token_ids)], device=self.device),
                position_ids=torch.arange(start, start + n, device=self.device)[None, :],
                past_key_values=self._caches[row.seq_id],
                use_cache=True,
                output_hidden_states=True,
            )
            self._lengths[row.seq_id] = start + n
            logits.append(out.logits[0, n - row.num_logits :].float())  # [m, V]
            hidden.append(torch.cat([out.hidden_states[i][0] for i in self.hidden_layers], dim=-1))  # [n, layers*H]
        num_selected = max(r.num_logits for r in rows)
        width = max(h.shape[0] for h in hidden)
        padded_logits = torch.zeros(len(rows), num_selected, self.vocab_size, device=self.device)
        padded_hidden = torch.zeros(len(rows), width, hidden[0].shape[-1], device=self.device, dtype=hidden[0].dtype)
        for b, (row_logits, row_hidden) in enumerate(zip(logits, hidden, strict=True)):
            padded_logits[b, : row_logits.shape[0]] = row_logits
            padded_hidden[b, : row_hidden.shape[0]] = row_hidden
        return ForwardOutput(logits=padded_logits, hidden_states=padded_hidden)
