"""Captured EAGLE chains and trees (eagle_head_graphs.py) draft exactly what the eager ones draft, reusing one graph per
padded shape. CPU has no graph API: a backend that replays by running the captured body again stands in for it,
so the padding, the static buffers and the shape buckets are checked here; the real capture needs CUDA."""

from __future__ import annotations


import pytest
import torch

from services.common.proposer import DraftInput
from services.drafter.eagle_catch_up import MAX_POSITIONS, MIN_POSITIONS, CatchUpGraphs, catch_up_body
from services.drafter.eagle_head_graphs import AHEAD_POSITIONS, MAX_ROWS, MIN_SPAN, HeadGraphs, draft_chains
from services.drafter.eagle_tree_candidates import tree_candidates
from services.drafter.methods.eagle import WARM_UP_SEQUENCE, EagleProposer
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
            again = forward()
            for output, new in zip(*((o,) if torch.is_tensor(o) else o for o in (drafted, again)), strict=True):
                output.copy_(new)

        return replay, drafted


def proposers(backend: ReplayingBackend):
    """An eager proposer and one drafting through `backend`, sharing a random head over a reduced vocabulary."""
    target = tiny_llama(seed=5, vocab_size=V)
    head = reduced_vocabulary_eagle_head(target, V)
    config = head.config
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    eager = EagleProposer(head, embed, lm_head, V)
    captured = EagleProposer(head, embed, lm_head, V)
    captured.chain_graphs = HeadGraphs(lambda inputs, k: draft_chains(head, embed, captured._draft_rows(), inputs, k),
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


@pytest.mark.parametrize(("rows", "span", "parameter", "shape"), [
    (1, 0, 1, (1, 4096, 1)), (1, 4097, 2, (1, 8192, 2)), (3, 65, 3, (4, 1024, 3)), (8, 1000, (8, 4), (8, 1024, (8, 4))),
    (200, 10, 4, (256, MIN_SPAN, 4)), (MAX_ROWS + 1, 10, 4, None)])
def test_calls_are_padded_to_few_shapes(rows, span, parameter, shape):
    """Rows to powers of two; the span too, from a floor of about 4,096 positions over the rows (a sequence
    crosses few of them in its life); the body's parameter as the caller gives it (chains round K up to a power of
    two themselves: the first test's calls of K 3 and 4 replay one graph)."""
    assert HeadGraphs.shape_for(rows, span, parameter) == shape


def test_shapes_up_to_the_servers_rows_are_captured_ahead():
    """Every row count up to the sequences served (powers of two), each span bucket from its floor while the graph
    reads at most AHEAD_POSITIONS, and no further than the longest sequence but the floor; each parameter once."""
    shapes = HeadGraphs.shapes_ahead(5, [1, 2, 2, 4])
    assert {rows for rows, _, _ in shapes} == {1, 2, 4, 8} and len(shapes) == len(set(shapes))
    eight = {(span, k) for rows, span, k in shapes if rows == 8}
    assert eight == {(span, k) for span in (512, 1024, 2048) for k in (1, 2, 4)}
    assert max(rows * span for rows, span, _ in shapes) == AHEAD_POSITIONS
    assert {(rows, span) for rows, span, _ in HeadGraphs.shapes_ahead(4, [1], max_span=1500)} == {
        (1, 4096), (2, 2048), (4, 1024), (4, 2048)}
    assert HeadGraphs.shapes_ahead(10**6, [1])[-1][0] == MAX_ROWS


def test_graphs_captured_ahead_serve_every_call_without_a_capture():
    """A proposer's graphs captured before serving (capture_graphs: up to 4 rows, K up to 4) take its warm-up and
    calls of 1 to 3 rows and K 1 to 4 with no capture more, graphs of one shape sharing its static buffers yet
    drafting what eager chains draft, call after call."""
    backend = ReplayingBackend()
    target, eager, captured = proposers(backend)
    assert captured.capture_graphs(4, 4, max_span=100) == 9  # rows 1, 2, 4 at their floors x K 1, 2, 4
    graphs = captured.chain_graphs._graphs
    assert graphs[(4, 1024, 1)].inputs is graphs[(4, 1024, 4)].inputs
    assert backend.captures == 9
    assert captured.warm_up(4) > 0 and backend.replays == 2  # a made-up sequence's first asks, kept nowhere
    assert not captured.prefix_cache._blocks and captured._sequences.keys() == {WARM_UP_SEQUENCE}
    generator = torch.Generator().manual_seed(6)
    sequences = {s: torch.randint(0, V, (n,), generator=generator).tolist() for s, n in (("a", 9), ("b", 30), ("c", 5))}
    for step, (count, k) in enumerate([(3, 2), (3, 4), (1, 1), (2, 3), (3, 4)]):
        chosen = dict(list(sequences.items())[:count])
        with torch.no_grad():
            states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                      for s, ids in chosen.items()}
        inputs = [DraftInput(s, ids, k, states[s]) for s, ids in chosen.items()]
        expected = [list(d.token_ids) for d in eager._draft_all(inputs)]
        assert [list(d.token_ids) for d in captured._draft_all(inputs)] == expected
        assert all(len(chain) == k for chain in expected)
        for s, chain in zip(chosen, expected, strict=True):
            sequences[s] += chain[:1] + [step + 1]
    assert backend.captures == 9 and backend.replays == 7 and WARM_UP_SEQUENCE not in captured._sequences


def test_the_catch_up_replays_a_graph_per_padded_size_and_drafts_what_eager_catch_up_drafts():
    """New positions' features and K/V through graphs of 8, 16, ... positions (eagle_catch_up.py): a new sequence of
    70 tokens, then steady steps, draft what the eager catch-up gives, whatever the padding rows hold."""
    backend = ReplayingBackend()
    target, eager, captured = proposers(backend)
    head, embed = captured.head, captured.embed
    captured.catch_up_graphs = CatchUpGraphs(catch_up_body(head, embed), backend, captured.state_width,
                                             torch.float32, torch.device("cpu"))
    assert captured.catch_up_graphs.capture_ahead(128) == 5  # 8, 16, 32, 64, 128
    assert CatchUpGraphs.size_for(3) == MIN_POSITIONS and CatchUpGraphs.size_for(MAX_POSITIONS + 1) is None
    generator = torch.Generator().manual_seed(11)
    sequences = {s: torch.randint(0, V, (n,), generator=generator).tolist() for s, n in (("a", 70), ("b", 6))}
    for step in range(4):
        with torch.no_grad():
            states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                      for s, ids in sequences.items()}
        inputs = [DraftInput(s, ids, 3, states[s]) for s, ids in sequences.items()]
        for graph in captured.catch_up_graphs._graphs.values():
            graph.states.fill_(1e4)
        assert [list(d.token_ids) for d in captured._draft_all(inputs)] == [
            list(d.token_ids) for d in eager._draft_all(inputs)]
        for s in sequences:
            sequences[s] += [step + 1, step + 2]
    assert backend.captures == 5 + 1 and backend.replays == 4 + 4  # the chain graph (2 rows, K 4), once


def test_captured_trees_draft_what_eager_trees_draft_and_reuse_their_graph():
    """Deterministic EAGLE-2 trees replay one graph of (rows, span, (topk, depth)) per shape, node for node what
    the eager candidates give, whatever an earlier replay left in the static buffers."""
    backend = ReplayingBackend()
    target = tiny_llama(seed=5, vocab_size=V)
    head = reduced_vocabulary_eagle_head(target, V)
    config = head.config
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    options = {"tree_nodes": 10, "tree_topk": 3, "tree_depth": 4}
    eager = EagleProposer(head, embed, lm_head, V, **options)
    captured = EagleProposer(head, embed, lm_head, V, **options)
    captured.tree_graphs = HeadGraphs(
        lambda inputs, tree: tree_candidates(head, embed, captured._draft_rows(), inputs, *tree, V), backend,
        config.num_key_value_heads, config.head_dim, config.hidden_size, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(8)
    sequences = {s: torch.randint(0, V, (n,), generator=generator).tolist() for s, n in (("a", 9), ("b", 30))}
    for step in range(3):
        with torch.no_grad():
            states = {s: target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                      for s, ids in sequences.items()}
        inputs = [DraftInput(s, ids, 10, states[s]) for s, ids in sequences.items()]
        expected = [(list(d.token_ids), list(d.parents)) for d in eager._draft_all(inputs)]
        for graph in captured.tree_graphs._graphs.values():
            graph.inputs.keys.fill_(1e4)
            graph.inputs.values.fill_(-1e4)
        assert [(list(d.token_ids), list(d.parents)) for d in captured._draft_all(inputs)] == expected
        assert all(len(tokens) == 10 for tokens, _ in expected)
        for s, (tokens, _) in zip(sequences, expected, strict=True):
            sequences[s] += tokens[:1] + [step + 1]
    assert backend.captures == 1 and backend.replays == 3 and len(captured.tree_graphs) == 1
    # ahead: 1 and 2 rows x the tree shapes of limits 1 to 10 (limits round to 1, 2, 4, 8, 16: (1, 1), (2, 2) and
    # (3, 4)), less the one captured above
    assert captured.capture_graphs(2, 10, max_span=100) == 5 and backend.captures == 6


def test_trees_captured_ahead_take_asks_of_every_node_limit_without_a_capture_in_a_call():
    """A tree drafter is asked for up to its tree_nodes tokens whatever its chain depth K: captured ahead with K = 4,
    trees of 10 nodes (top-8, depth 4) have their whole shape captured too ((8, 4), beside (1, 1), (2, 2) and
    (4, 4)), so a call asking 10 tokens replays it. Before, only the limits up to K were captured, and on an H200
    the capture inside such a call made the planner stop asking the trees."""
    backend = ReplayingBackend()
    target = tiny_llama(seed=5, vocab_size=V)
    head = reduced_vocabulary_eagle_head(target, V)
    config = head.config
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    proposer = EagleProposer(head, embed, lm_head, V, tree_nodes=10, tree_topk=8, tree_depth=4)
    proposer.tree_graphs = HeadGraphs(
        lambda inputs, tree: tree_candidates(head, embed, proposer._draft_rows(), inputs, *tree, V), backend,
        config.num_key_value_heads, config.head_dim, config.hidden_size, torch.float32, torch.device("cpu"))
    assert proposer.capture_graphs(1, 4, max_span=64) == 4 and backend.captures == 4
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        states = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
    (tree,) = proposer._draft_all([DraftInput("a", ids, 10, states)])
    assert len(tree.token_ids) == 10 and backend.captures == 4 and backend.replays == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures real CUDA graphs")
@torch.no_grad()
def test_cuda_graphs_draft_what_eager_chains_and_trees_draft():
    """Real CUDA graphs (TorchGraphs): chains and their catch-up (captured ahead) and deterministic trees (as calls
    come), replayed for calls of two rows, then of one row whose cache grew, equal what the same proposer drafts
    eagerly on the GPU."""
    device = torch.device("cuda")
    target = tiny_llama(seed=5, vocab_size=V).to(device)
    head = reduced_vocabulary_eagle_head(target, V).to(device)
    head.fuse_sibling_linears()  # as build_proposer runs a head on an accelerator
    config = head.config
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    shape = (config.num_key_value_heads, config.head_dim, config.hidden_size, torch.float32, device)
    for options in ({}, {"tree_nodes": 10, "tree_topk": 3, "tree_depth": 4}):
        eager = EagleProposer(head, embed, lm_head, V, **options)
        captured = EagleProposer(head, embed, lm_head, V, **options)
        captured.chain_graphs = HeadGraphs.for_device(
            lambda inputs, k: draft_chains(head, embed, captured._draft_rows(), inputs, k), *shape)
        captured.tree_graphs = HeadGraphs.for_device(
            lambda inputs, tree: tree_candidates(head, embed, captured._draft_rows(), inputs, *tree, V), *shape)
        if not options:  # chains with their catch-up captured too
            captured.catch_up_graphs = CatchUpGraphs.for_device(catch_up_body(head, embed), captured.state_width,
                                                                torch.float32, device)
        graphs = captured.tree_graphs if options else captured.chain_graphs
        ahead = 0 if options else captured.capture_graphs(2, 4, max_span=64)  # trees: captured as calls come
        if not options:
            captured.warm_up(4)
        seconds = graphs.capture_seconds
        generator = torch.Generator().manual_seed(9)
        sequences = {s: torch.randint(0, V, (n,), generator=generator).tolist() for s, n in (("a", 9), ("b", 40))}
        for step in range(3):
            if step == 2:
                del sequences["a"]
            states = {s: target.model(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0, :-1]
                      for s, ids in sequences.items()}
            inputs = [DraftInput(s, ids, 4 if not options else 10, states[s]) for s, ids in sequences.items()]
            expected = [(list(d.token_ids), d.parents) for d in eager._draft_all(inputs)]
            assert [(list(d.token_ids), d.parents) for d in captured._draft_all(inputs)] == expected
            for s, (tokens, _) in zip(sequences, expected, strict=True):
                sequences[s] += tokens[:1] + [step + 1]
        if options:
            assert len(graphs) == 2 and graphs.capture_seconds > 0
        else:  # rows 1 and 2 x K 1, 2 and 4, and catch-ups of 8 to 512 positions, all before the calls
            assert ahead == len(graphs) + len(captured.catch_up_graphs) == 6 + 7
            assert graphs.capture_seconds == seconds > 0
