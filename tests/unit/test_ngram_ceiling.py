"""The ngram ceiling's step count: a copied answer commits K + 1 tokens a step, a new one one a step."""

from __future__ import annotations

from services.bench.ngram_ceiling import steps_to_commit
from services.drafter.methods.ngram import NgramSettings


def test_a_copied_answer_commits_k_plus_one_a_step_and_a_new_one_one():
    text = list(range(100, 140))
    prompt = [1, 2, *text, 3]
    # the answer repeats the text: after its first token the lookup finds it, and every draft lands
    steps, empty = steps_to_commit(prompt, text, 4, NgramSettings())
    assert empty == 1  # the first step: the prompt's last token occurs nowhere before it
    assert steps == 1 + -(-(len(text) - 1) // 5)  # the first token alone, then K + 1 = 5 a step
    new = list(range(500, 520))  # nothing to look up: each step commits the target's own token
    assert steps_to_commit(prompt, new, 4, NgramSettings()) == (20, 20)
