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


def random_workload(seed: int, n: int, prompt_lengths: tuple[int, int], max_token_range: tuple[int, int]):
    """n repetitive prompts of lengths in prompt_lengths and their max_tokens in max_token_range, drawn from
    `seed`: (prompts, max_tokens)."""
    rng = random.Random(seed)
    prompts = [repetitive_prompt(rng, rng.randint(*prompt_lengths)) for _ in range(n)]
    return prompts, [rng.randint(*max_token_range) for _ in range(n)]
