"""Captured EAGLE chains (eagle_chain_graphs.py) draft exactly what the eager chains draft, reusing one graph per
padded shape. CPU has no graph API: a backend that replays by running the captured body again stands in for it,
so the padding, the static buffers and the shape buckets are checked here; the real capture needs CUDA."""

from __future__ import annotations


import pytest
import torch

from services.common.proposer import DraftInput
from services.drafter.eagle_chain_graphs import MAX_ROWS, MIN_SPAN, ChainGraphs, draft_chains
from services.drafter.methods.eagle import EagleProposer
from tests.tiny_heads import reduced_vocabulary_eagle_head
from tests.tiny_models import tiny_llama

V = 96


class ReplayingBackend:
    """Replays by running the body again into the captured output, as a graph replay overwrites it."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.captures = 0
        self.replays = 0

    def capture(self, forward):
        self.captures += 1
        drafted = forward()
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

        def replay() -> None:
            self.replays += 1
            drafted.copy_(forward())

        return replay, drafted


def proposers(backend: ReplayingBackend):
    """An eager proposer and one drafting through `backend`, sharing a random head over a reduced vocabulary."""
    target = tiny_llama(seed=5, vocab_size=V)
    head = reduced_vocabulary_eagle_head(target, V)
    config = head.config
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    eager = EagleProposer(head, embed, lm_head, V)
    captured = EagleProposer(head, embed, lm_head, V)
    captured.chain_graphs = ChainGraphs(lambda inputs, k: draft_chains(head, embed, captured._lm_rows(), inputs, k),
                                        backend, config.num_key_value_heads, config.head_dim, config.hidden_size,
                                        torch.float32, torch.device("cpu"))
    return target, eager, captured


def test_captured_chains_draft_what_eager_chains_draft_and_reuse_their_graph():
    backend = ReplayingBackend()
    target, eager, captured = proposers(backend)
    generator = torch.Generator().manual_seed(3)
    sequences = {s: torch.randint(0, V, (n,), generator=generator).tolist()
                 for s, n in (("a", 9), ("b", 2), ("c", 70))}
    wanted = {"a": 4, "b": 2, "c": 3}
    for step in range(3):
        with torch.no_grad():
            states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                      for s, ids in sequences.items()}
        inputs = [DraftInput(s, ids, wanted[s], states[s]) for s, ids in sequences.items()]
        expected = [list(d.token_ids) for d in eager._draft_all(inputs)]
        for graph in captured.chain_graphs._graphs.values():  # what earlier calls left must not be read
            graph.inputs.keys.fill_(1e4)
            graph.inputs.values.fill_(-1e4)
        assert [list(d.token_ids) for d in captured._draft_all(inputs)] == expected
        assert [len(chain) for chain in expected] == [4, 2, 3]
        for s, chain in zip(sequences, expected, strict=True):  # a step later: the drafts partly accepted
            sequences[s] += chain[:1] + [step + 1]
    assert backend.captures == 1 and backend.replays == 3  # (4 rows, 1,024 positions, K 4) every time
    assert len(captured.chain_graphs) == 1


def test_a_shape_the_platform_refuses_drafts_eagerly_and_is_not_tried_again():
    backend = ReplayingBackend(fail=True)
    target, eager, captured = proposers(backend)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        states = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
    for seq in ("x", "y"):
        inputs = [DraftInput(seq, ids, 3, states)]
        assert captured._draft_all(inputs)[0].token_ids == eager._draft_all(inputs)[0].token_ids
    assert backend.captures == 1 and len(captured.chain_graphs) == 0


@pytest.mark.parametrize(("rows", "span", "k", "shape"), [
    (1, 0, 1, (1, 4096, 1)), (1, 4097, 2, (1, 8192, 2)), (3, 65, 3, (4, 1024, 4)), (8, 1000, 4, (8, 1024, 4)),
    (200, 10, 4, (256, MIN_SPAN, 4)), (MAX_ROWS + 1, 10, 4, None)])
def test_chains_are_padded_to_few_shapes(rows, span, k, shape):
    """Rows and K to powers of two; the span too, from a floor of about 4,096 positions over the rows (a sequence
    crosses few of them in its life)."""
    assert ChainGraphs.shape_for(rows, span, k) == shape
