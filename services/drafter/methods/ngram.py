"""Prompt-lookup (n-gram) drafting: find the sequence's last n tokens earlier in the sequence and propose what
followed them there. Free to compute, and very effective when the output copies from the prompt (code edits,
summaries, RAG). Same knobs as vLLM's `ngram` method."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from services.common.proposer import Draft, DraftInput
from services.common.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class NgramSettings:
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )


def propose_ngram(tokens: np.ndarray, k: int, settings: NgramSettings) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the longest matching suffix n-gram
    (n from prompt_lookup_max down to prompt_lookup_min)."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(settings.prompt_lookup_max, length - 1), settings.prompt_lookup_min - 1, -1):
        suffix = tokens[length - n :]
        windows = sliding_window_view(tokens[: length - 1], n)  # every earlier n-gram start, excluding the suffix
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    method = "ngram"

    def __init__(self, settings: NgramSettings | None = None) -> None:
        self.settings = settings or NgramSettings()

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [
            Draft(propose_ngram(np.asarray(item.token_ids, dtype=np.int64), item.num_speculative_tokens, self.settings))
            for item in inputs
        ]

    def release(self, seq_id: Hashable) -> None:
        """Stateless: nothing to forget."""


def build_proposer(config: SpeculativeConfig) -> NgramProposer:
    """The registry's entry point (services/common/drafter_methods.py)."""
    options = config.options  # NgramOptions (services/common/method_options.py)
    return NgramProposer(NgramSettings(options.prompt_lookup_min, options.prompt_lookup_max))
