"""The EAGLE head's matmuls on CPU through the kernels measured fastest (head_kernels.py): a head whose layers and
draft rows run packed drafts what the plain head drafts, chains and trees alike; the choice times whole draft
steps, one candidate at a time; on bfloat16 copies a head's scores are its float32 scores to bfloat16's
precision."""

from __future__ import annotations

import torch

from services.common.proposer import DraftInput
from services.drafter.head_kernels import ROUNDS, STEP_ROWS, ChosenLinear, use_chosen_kernels
from services.drafter.methods.eagle import EagleProposer
from services.modeling.cpu_linear import packed_linear
from tests.cpu_features import needs_bf16_linear
from tests.tiny_heads import reduced_vocabulary_eagle_head
from tests.tiny_models import tiny_llama

V = 96


def winner(fastest: str, calls: list | None = None):
    """A fake step timer under which `fastest` always wins (every timed step still runs)."""

    def measure(name, rows, step) -> float:
        scores = step()
        if calls is not None:
            calls.append((name, rows, tuple(scores.shape)))
        return 0.1 if name == fastest else 1.0

    return measure


@torch.no_grad()
def test_a_head_on_chosen_kernels_drafts_what_the_plain_head_drafts():
    assert packed_linear([torch.zeros(4, 4)], [None]) is not None, "oneDNN packing is unavailable in this torch"
    target = tiny_llama(seed=5, vocab_size=V)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    generator = torch.Generator().manual_seed(2)
    sequences = {s: torch.randint(0, V, (n,), generator=generator).tolist() for s, n in (("a", 9), ("b", 30))}
    states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1] for s, ids in sequences.items()}
    for options in ({}, {"tree_nodes": 8, "tree_topk": 3, "tree_depth": 3}):
        torch.manual_seed(0)
        plain = EagleProposer(reduced_vocabulary_eagle_head(target, V), embed, lm_head, V, **options)
        torch.manual_seed(0)
        chosen = EagleProposer(reduced_vocabulary_eagle_head(target, V), embed, lm_head, V, **options)
        rows = chosen._draft_rows()
        chosen.draft_rows = use_chosen_kernels(chosen.head, rows, winner("packed"))
        assert chosen.draft_rows is not rows and chosen.draft_rows.weight is rows.weight
        replaced = [m for m in chosen.head.modules() if isinstance(m, ChosenLinear)]
        assert len(replaced) == 8 and not any(isinstance(m, torch.nn.Linear) for m in chosen.head.modules())
        inputs = [DraftInput(s, ids, 4 if not options else 8, states[s]) for s, ids in sequences.items()]
        expected = [(list(d.token_ids), d.parents) for d in plain._draft_all(inputs)]
        assert [(list(d.token_ids), d.parents) for d in chosen._draft_all(inputs)] == expected
        assert all(tokens for tokens, _ in expected)


@torch.no_grad()
@needs_bf16_linear
def test_the_choice_times_whole_draft_steps_and_bf16_scores_are_the_float32_scores_rounded():
    target = tiny_llama(seed=5, vocab_size=V)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    torch.manual_seed(0)
    plain = EagleProposer(reduced_vocabulary_eagle_head(target, V), embed, lm_head, V)
    torch.manual_seed(0)
    rounded = EagleProposer(reduced_vocabulary_eagle_head(target, V), embed, lm_head, V)
    calls = []
    rows = rounded._draft_rows()
    rounded.draft_rows = use_chosen_kernels(rounded.head, rows, winner("bf16", calls))
    draft_vocabulary = rows.weight.shape[0]
    # each candidate timed as a whole step (its scores over the draft vocabulary), at each row count, warm-up
    # round included
    assert sorted(set(calls)) == sorted((name, m, (m, draft_vocabulary)) for name in ("plain", "packed", "bf16")
                                        for m in STEP_ROWS)
    assert len(calls) == 3 * len(STEP_ROWS) * (ROUNDS + 1)
    outputs = torch.randn(5, 1, rows.weight.shape[1])
    features = torch.randn(5, 1, rows.weight.shape[1])
    expected = plain.head.draft_scores(plain.head(outputs, features)[:, -1], plain._draft_rows())
    got = rounded.head.draft_scores(rounded.head(outputs, features)[:, -1], rounded.draft_rows)
    assert not torch.equal(got, expected), "the float32 products: the bf16 copies did not run"
    torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0.02)
