"""The EAGLE drafter's chains, batched across sequences (caches padded to one length) and over a reduced draft
vocabulary, are exactly the chains each sequence drafts alone with the head's incremental `step`: the batching
changes the cost of drafting, never a draft."""

from __future__ import annotations

from dataclasses import asdict

import torch

from services.common.proposer import DraftInput
from services.drafter.methods.eagle import EagleProposer
from services.modeling.eagle_head import EagleConfig, EagleHead
from tests.tiny_models import tiny_llama

V = 96


def reference_chain(head: EagleHead, embed, weight, tokens: list[int], states: torch.Tensor, k: int) -> list[int]:
    """One sequence alone: commit positions 0..n-2, then K argmax steps feeding back the head's own features."""
    n = len(tokens) - 1
    cache = None
    if n > 1:
        _, cache = head.step(embed(torch.tensor([tokens[1:n]])), states[None, : n - 1], 0, None)
    token, feature, chain = tokens[n], states[None, n - 1 : n], []
    for j in range(k):
        out, cache = head.step(embed(torch.tensor([[token]])), feature, n - 1 + j, cache)
        token = int(head.token_ids((out[:, -1] @ weight.T).argmax(-1)))
        chain.append(token)
        feature = out
    return chain


def test_batched_chains_over_a_reduced_vocabulary_equal_each_sequence_alone():
    target = tiny_llama(seed=5, vocab_size=V)
    torch.manual_seed(1)
    config = EagleConfig(**{**asdict(EagleConfig.for_target(target.config)), "draft_vocab_size": 40})
    head = EagleHead(config).eval()
    head.draft_vocab.copy_(torch.randperm(V)[:40].sort().values)
    with torch.no_grad():  # a random head drafts poorly: make its features count so chains differ per sequence
        head.fc.weight.mul_(4)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    proposer = EagleProposer(head, embed, lm_head, V)
    sequences = {"a": torch.randint(0, V, (9,)).tolist(), "b": torch.randint(0, V, (2,)).tolist(),
                 "c": torch.randint(0, V, (17,)).tolist()}
    wanted = {"a": 4, "b": 2, "c": 3}
    with torch.no_grad():
        states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                  for s, ids in sequences.items()}
        expected = {s: reference_chain(head, embed, head.draft_weight(lm_head.weight), ids, states[s], wanted[s])
                    for s, ids in sequences.items()}
    inputs = [DraftInput(s, ids, wanted[s], states[s]) for s, ids in sequences.items()]
    drafts = proposer._draft_all(inputs)
    assert {s: list(d.token_ids) for s, d in zip(sequences, drafts, strict=True)} == expected
    assert all(t in set(head.draft_vocab.tolist()) for chain in expected.values() for t in chain)
    # a step later, with more tokens committed (the cache catches up), still the same as alone
    sequences["a"] += expected["a"][:2] + [7]
    with torch.no_grad():
        states["a"] = target.model(input_ids=torch.tensor([sequences["a"]])).last_hidden_state[0, :-1]
        again = reference_chain(head, embed, head.draft_weight(lm_head.weight), sequences["a"], states["a"], 4)
    drafts = proposer._draft_all([DraftInput("a", sequences["a"], 4, states["a"]),
                                  DraftInput("b", sequences["b"], 0, states["b"])])
    assert list(drafts[0].token_ids) == again and list(drafts[1].token_ids) == []


def test_a_repeated_prefix_takes_the_head_cache_and_drafts_the_same():
    """A second sequence whose tokens start like the first's takes the head's K/V of their shared full blocks
    from the prefix cache, feeds only the rest, and drafts exactly what it drafts alone; a sequence that differs
    inside the first block takes nothing."""
    target = tiny_llama(seed=5, vocab_size=V)
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.for_target(target.config)).eval()
    with torch.no_grad():
        head.fc.weight.mul_(4)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    shared = torch.randint(0, V, (40,)).tolist()
    sequences = {"first": shared + [5, 6], "second": shared + [9, 10, 11], "other": [1] + shared[1:] + [5]}
    with torch.no_grad():
        states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                  for s, ids in sequences.items()}
        expected = {s: reference_chain(head, embed, lm_head.weight, ids, states[s], 4) for s, ids in sequences.items()}
    proposer = EagleProposer(head, embed, lm_head, V)
    fed = []
    step = head.step
    head.step = lambda embeddings, *rest: fed.append(embeddings.shape[1]) or step(embeddings, *rest)
    for name in sequences:
        fed.clear()
        draft = proposer._draft_all([DraftInput(name, sequences[name], 4, states[name])])[0]
        assert list(draft.token_ids) == expected[name], name
        catch_up = fed[0]  # the first head step feeds the committed positions the cache does not hold
        if name == "second":  # 32 of its 43 positions (two full blocks of 16) came from the cache
            assert catch_up == len(sequences[name]) - 2 - 32 and proposer.prefix_cache.hits == 32
        else:
            assert catch_up == len(sequences[name]) - 2, name
