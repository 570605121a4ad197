"""Token prompts for the tiny random models."""

from __future__ import annotations

import random

from tests.tiny_models import VOCAB


def repetitive_prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    """Prompts that repeat short phrases, so n-gram lookup finds matches (some accepted, some not)."""
    phrases = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))] for _ in range(4)]
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(VOCAB)]
    return tuple(tokens[:length])
