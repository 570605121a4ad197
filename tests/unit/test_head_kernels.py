"""The EAGLE head's matmuls on CPU through the kernels measured fastest (head_kernels.py): a head whose layers and
draft rows run packed drafts what the plain head drafts, chains and trees alike."""

from __future__ import annotations

import torch

from services.common.proposer import DraftInput
from services.drafter.head_kernels import ChosenLinear, use_chosen_kernels
from services.drafter.methods.eagle import EagleProposer
from services.modeling.cpu_linear import packed_linear
from services.modeling.kernel_choice import KernelChooser
from tests.tiny_heads import reduced_vocabulary_eagle_head
from tests.tiny_models import tiny_llama

V = 96


def packed_wins(name, kernel, x) -> float:
    """A fake timer under which the packed kernel is always the faster (and every call still runs)."""
    kernel(x)
    return 0.1 if name == "packed" else 1.0


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
        chosen.draft_rows = use_chosen_kernels(chosen.head, rows, KernelChooser(measure=packed_wins))
        assert chosen.draft_rows is not rows and chosen.draft_rows.weight is rows.weight
        replaced = [m for m in chosen.head.modules() if isinstance(m, ChosenLinear)]
        assert len(replaced) == 8 and not any(isinstance(m, torch.nn.Linear) for m in chosen.head.modules())
        inputs = [DraftInput(s, ids, 4 if not options else 8, states[s]) for s, ids in sequences.items()]
        expected = [(list(d.token_ids), d.parents) for d in plain._draft_all(inputs)]
        assert [(list(d.token_ids), d.parents) for d in chosen._draft_all(inputs)] == expected
        assert all(tokens for tokens, _ in expected)
