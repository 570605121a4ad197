"""The EAGLE drafter's chains, batched across sequences (caches padded to one length) and over a reduced draft
vocabulary, are exactly the chains each sequence drafts alone with the head's incremental `step`: the batching
changes the cost of drafting, never a draft."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.proposer import DraftInput
from services.drafter.methods.eagle import EagleProposer
from services.modeling.eagle_head import EagleConfig, EagleHead
from tests.tiny_heads import reduced_vocabulary_eagle_head
from tests.tiny_models import tiny_llama

V = 96


def reference_chain(head: EagleHead, embed, weight, tokens: list[int], states: torch.Tensor, k: int,
                    forced: Sequence[int] = ()) -> list[int]:
    """One sequence alone: commit positions 0..n-2, then K argmax steps feeding back the head's own features
    (the first ones taking the `forced` tokens instead of their argmax)."""
    n = len(tokens) - 1
    cache = None
    if n > 1:
        _, cache = head.step(embed(torch.tensor([tokens[1:n]])), states[None, : n - 1], 0, None)
    token, feature, chain = tokens[n], states[None, n - 1 : n], []
    for j in range(k):
        out, cache = head.step(embed(torch.tensor([[token]])), feature, n - 1 + j, cache)
        token = forced[j] if j < len(forced) else int(head.token_ids((out[:, -1] @ weight.T).argmax(-1)))
        chain.append(token)
        feature = out
    return chain


def random_head(seed: int):
    """The tiny target, a random head over its whole vocabulary (seeded), and the target's embedding and LM head.
    A random head drafts poorly: its features are scaled so that they count and chains differ per sequence."""
    target = tiny_llama(seed=5, vocab_size=V)
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(target.config)).eval()
    with torch.no_grad():
        head.fc.weight.mul_(4)
    return target, head, target.get_input_embeddings(), target.get_output_embeddings()


def test_batched_chains_over_a_reduced_vocabulary_equal_each_sequence_alone():
    target = tiny_llama(seed=5, vocab_size=V)
    head = reduced_vocabulary_eagle_head(target, V)
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
    batches = []
    keys_values = head.keys_values
    head.keys_values = lambda embeddings, *rest: batches.append(embeddings.shape[1]) or keys_values(embeddings, *rest)
    drafts = proposer._draft_all(inputs)
    assert {s: list(d.token_ids) for s, d in zip(sequences, drafts, strict=True)} == expected
    # every sequence's new positions in one batch: the committed ones and the last (its K/V a chain's first step)
    assert batches == [(9 - 1) + (2 - 1) + (17 - 1)]
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
    target, head, embed, lm_head = random_head(seed=2)
    shared = torch.randint(0, V, (40,)).tolist()
    sequences = {"first": shared + [5, 6], "second": shared + [9, 10, 11], "other": [1] + shared[1:] + [5]}
    with torch.no_grad():
        states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                  for s, ids in sequences.items()}
        expected = {s: reference_chain(head, embed, lm_head.weight, ids, states[s], 4) for s, ids in sequences.items()}
    proposer = EagleProposer(head, embed, lm_head, V)
    fed = []
    keys_values = head.keys_values
    head.keys_values = lambda embeddings, *rest: fed.append(embeddings.shape[1]) or keys_values(embeddings, *rest)
    for name in sequences:
        fed.clear()
        draft = proposer._draft_all([DraftInput(name, sequences[name], 4, states[name])])[0]
        assert list(draft.token_ids) == expected[name], name
        catch_up = fed[0]  # the positions the cache does not hold, fed before the chain (the last one's K/V too)
        if name == "second":  # 32 of its 43 positions (two full blocks of 16) came from the cache
            assert catch_up == len(sequences[name]) - 1 - 32 and proposer.prefix_cache.hits == 32
        else:
            assert catch_up == len(sequences[name]) - 1, name


def test_a_sequence_head_cache_grows_in_place_and_drafts_as_alone_at_every_call():
    """A sequence's head cache is fed a few positions a call into buffers that double when full: across 40 calls
    (8 to 90 committed tokens) every chain equals the one drafted alone, and the cache moved to a new buffer only
    when it grew past one (a cat per call made a new one every time)."""
    target, head, embed, lm_head = random_head(seed=3)
    tokens = torch.randint(0, V, (8,)).tolist()
    proposer = EagleProposer(head, embed, lm_head, V)
    buffers, generator = [], torch.Generator().manual_seed(4)
    for _ in range(40):
        with torch.no_grad():
            states = target.model(input_ids=torch.tensor([tokens])).last_hidden_state[0, :-1]
            expected = reference_chain(head, embed, lm_head.weight, tokens, states, 3)
        assert list(proposer._draft_all([DraftInput("a", tokens, 3, states)])[0].token_ids) == expected
        buffers.append(proposer._sequences["a"].keys.view().untyped_storage().data_ptr())
        more = int(torch.randint(1, 4, (), generator=generator))
        tokens += torch.randint(0, V, (more,), generator=generator).tolist()
    assert len(tokens) > 64 + 8 and len(set(buffers)) == 2  # capacity 64, then 128


def test_a_pre_draft_continues_the_chain_past_the_answered_draft_and_answers_exactly_its_guess():
    """Pipelining: after a call, the chain runs on past the answered draft d (its argmax g, then K more). The
    next call gets that pre-draft only if its committed tokens are exactly committed + d + g, without a chain
    of its own; the pre-draft after it forces the answered tokens onto a chain over the target's new states.
    Any other committed tokens get a fresh chain."""
    target, head, embed, lm_head = random_head(seed=10)
    proposer = EagleProposer(head, embed, lm_head, V, pipelining=True)

    def states_of(ids):
        with torch.no_grad():
            return target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]

    def reference(ids, k, forced=()):
        with torch.no_grad():
            return reference_chain(head, embed, lm_head.weight, ids, states_of(ids), k, forced)

    committed = torch.randint(0, V, (12,)).tolist()
    draft = list(proposer._draft_all([DraftInput("a", committed, 3, states_of(committed))])[0].token_ids)
    assert draft == reference(committed, 3)
    proposer._predraft([(DraftInput("a", tuple(committed), 3, states_of(committed)), tuple(draft))], lambda: False)
    chain = reference(committed, 7)  # d, then g, then the pre-draft
    guess = committed + chain[:4]
    chains = []
    head_step = head.step_tree  # what a chain's steps run (eagle_head_graphs.draft_chains)
    head.step_tree = lambda *args: chains.append(1) or head_step(*args)
    answered = list(proposer._draft_all([DraftInput("a", guess, 3, states_of(guess))])[0].token_ids)
    assert answered == chain[4:] and chains == [] and proposer.pipeline_counts.used == 1
    proposer._predraft([(DraftInput("a", tuple(guess), 3, states_of(guess)), tuple(answered))], lambda: False)
    after = reference(guess, 7, forced=answered)
    assert after[3:] != reference(guess, 7)[3:]  # with this head, forcing the answered tokens matters
    pending = proposer.predrafts._by_seq["a"]
    assert pending.base.tolist() == guess + answered + after[3:4] and list(pending.tokens) == after[4:]
    wrong_bonus = guess + answered + [(after[3] + 1) % V]
    fresh = list(proposer._draft_all([DraftInput("a", wrong_bonus, 3, states_of(wrong_bonus))])[0].token_ids)
    assert fresh == reference(wrong_bonus, 3) and proposer.pipeline_counts.discarded == 1
    proposer._predraft([(DraftInput("a", tuple(wrong_bonus), 3, states_of(wrong_bonus)), tuple(fresh))],
                       lambda: True)  # a call came at once: stopped
    assert proposer.pipeline_counts.discarded == 2 and not proposer.predrafts.take("a", wrong_bonus, 3)


def test_a_tree_is_pre_drafted_along_its_first_path():
    """With trees, the pre-draft's guess is the tree's first path accepted whole (the head's likeliest chain): a
    next call that commits that path and the guessed bonus is answered from it."""
    from services.common.token_trees import leaf_paths
    from services.drafter.methods.eagle import guessed_path

    target, head, embed, lm_head = random_head(seed=10)
    proposer = EagleProposer(head, embed, lm_head, V, pipelining=True, tree_nodes=6, tree_topk=2, tree_depth=3)

    def states_of(ids):
        with torch.no_grad():
            return target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]

    committed = torch.randint(0, V, (12,)).tolist()
    tree = proposer._draft_all([DraftInput("a", committed, 6, states_of(committed))])[0]
    path = guessed_path(tree)
    assert list(path) == [tree.token_ids[i] for i in leaf_paths(tree.parents)[0]] and len(path) < len(tree.token_ids)
    proposer._predraft([(DraftInput("a", tuple(committed), 6, states_of(committed)), path)], lambda: False)
    pending = proposer.predrafts._by_seq["a"]
    assert pending.base.tolist()[: len(committed) + len(path)] == committed + list(path)
    guess = pending.base.tolist()
    answered = proposer._draft_all([DraftInput("a", guess, 6, states_of(guess))])[0]
    assert list(answered.token_ids) == list(pending.tokens) and proposer.pipeline_counts.used == 1
