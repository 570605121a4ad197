"""The captured-forward path (step_graphs.py) computes what the eager forward does.

On CPU there is no graph to capture, so a backend behind the same protocol replays by running the forward again on
the graph's static inputs: everything but the capture itself is what a GPU runs (rows padded to a capture size, the
span rounded up to its bucket, the padding written to the sink, inputs copied into one static buffer and read
through views, outputs taken from the static ones). The test marked for CUDA captures for real.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.method_options import MAX_SPECULATIVE_TOKENS
from services.modeling.forward_batch import TREE_CAPABLE_WIDTH, build_forward_batch
from services.modeling.kv_budget import KVCacheConfig
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.runner import RowInput
from services.modeling.step_graphs import MIN_SPAN, GraphSettings, StepGraphs, default_capture_sizes, width_bucket
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2


class RerunOnReplay:
    """A GraphBackend for CPU: 'capturing' runs the forward, a replay runs it again into the static outputs."""

    def __init__(self) -> None:
        self.captures = self.replays = 0

    def capture(self, forward):
        self.captures += 1
        outputs = forward()

        def replay() -> None:
            self.replays += 1
            for static, fresh in zip(outputs, forward(), strict=True):
                static.copy_(fresh)

        return replay, outputs


def make_runner(model, device=torch.device("cpu"), graphs: GraphSettings | None = None) -> LlamaFamilyRunner:
    return LlamaFamilyRunner(model, max_num_seqs=8, max_model_len=512, pack_weights=False, graphs=graphs,
                             kv_cache=KVCacheConfig(memory_bytes=8 << 20, block_size=8))


def with_rerun_graphs(model, sizes=(1, 2, 4), max_width=8) -> tuple[LlamaFamilyRunner, RerunOnReplay]:
    runner = make_runner(model)
    backend = RerunOnReplay()
    # no span floor beyond MIN_SPAN, so that sequences cross span buckets within the tiny model's context
    runner.graphs = StepGraphs(runner._body, backend, sizes, runner.device, max_width=max_width, gather_positions=0)
    return runner, backend


def test_capture_sizes_and_shapes_follow_vllm():
    assert default_capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_capture_sizes(3) == (1, 2, 3) and default_capture_sizes(12) == (1, 2, 4, 8, 12)
    graphs = StepGraphs(lambda batch: None, RerunOnReplay(), (1, 2, 4, 8), torch.device("cpu"), max_width=16,
                        gather_positions=0)
    assert graphs.shape_for(3, 5, 10) == (4, 5, MIN_SPAN)
    assert graphs.shape_for(3, 4, 10) == (4, 5, MIN_SPAN)  # widths pad up to 1 + a power of two drafts
    assert graphs.shape_for(1, 1, MIN_SPAN + 1) == (1, 1, 2 * MIN_SPAN)
    assert graphs.shape_for(8, 9, 1000) == (8, 9, 1024)
    assert graphs.shape_for(9, 1, 10) is None and graphs.shape_for(1, 10, 10) is None  # run eagerly
    every_size = (1, 2, 4, 8)
    assert graphs.shapes_to_capture(9) == [(rows, width, MIN_SPAN) for rows in every_size for width in (1, 2, 3, 5, 9)]
    assert graphs.shapes_to_capture(4) == [(rows, width, MIN_SPAN) for rows in every_size for width in (1, 2, 3, 5)]
    assert StepGraphs.for_runner(lambda batch: None, torch.device("cpu"), 8, 512, GraphSettings()) is None
    assert StepGraphs.for_runner(lambda batch: None, torch.device("meta"), 8, 512, GraphSettings()) is None


def test_small_batches_read_longer_spans_so_one_graph_serves_a_sequence_a_while():
    graphs = StepGraphs(lambda batch: None, RerunOnReplay(), (1, 2, 4, 8, 16, 24, 32), torch.device("cpu"),
                        max_span=3000, gather_positions=1024)
    assert [graphs.span_floor(rows) for rows in (1, 2, 4, 8, 16, 24, 32)] == [1024, 512, 256, 256, 256, 256, 256]
    # a verify's tokens each read the span: wider rows take the floor of as many more rows (attention's work)
    assert [graphs.span_floor(1, width) for width in (1, 2, 3, 5, 9)] == [1024, 512, 256, 256, 256]
    assert graphs.shape_for(1, 1, 10) == (1, 1, 1024) and graphs.shape_for(1, 5, 10) == (1, 5, 256)
    assert graphs.shape_for(1, 2, 300) == (1, 2, 512) and graphs.shape_for(1, 5, 2999) == (1, 5, 4096)
    assert graphs.shape_for(2, 1, 600) == (2, 1, 1024) and graphs.shape_for(20, 1, 10) == (24, 1, 256)
    assert graphs.shapes_to_capture(4)[:4] == [(1, 1, 1024), (1, 2, 512), (1, 3, 256), (1, 5, 256)]
    capped = StepGraphs(lambda batch: None, RerunOnReplay(), (1, 2), torch.device("cpu"), max_span=500)
    assert capped.shape_for(1, 1, 10) == (1, 1, 512)  # never past the longest sequence's bucket
    assert capped.shapes_to_capture(2) == [(1, 1, 512), (1, 2, 512), (2, 1, 512), (2, 2, 256)]


@pytest.mark.parametrize("max_width", [8, 512], ids=["prefill-eager", "prefill-graphed"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_graph_shaped_forwards_match_eager_ones(make_model, max_width):
    """Three sequences decode side by side through steps of 1 token, chains of drafts and a tree, with rollbacks,
    across the first span bucket's end; prefill is wider than graphs of max_width 8 take and runs eagerly there,
    padded to 64 and 256 tokens in graphs of 512."""
    model = make_model()
    eager = make_runner(model)
    graphed, backend = with_rerun_graphs(model, max_width=max_width)
    # short sequences' graphs captured ahead, from padding alone, as the engine does before its first step
    assert graphed.capture_graphs(5) == 3 * 4 and graphed.capture_graphs(5) == 0
    rng = random.Random(3)
    prompts = {s: [rng.randrange(VOCAB) for _ in range(n)] for s, n in (("a", 240), ("b", 40), ("c", 250))}
    for runner in (eager, graphed):
        for seq, prompt in prompts.items():
            runner.add_sequence(seq)
            runner.forward([RowInput(seq, prompt, num_logits=1)])
    for step in range(20):
        live = ["a", "b", "c"][: 1 + step % 3]
        rows = []
        for seq in live:
            width = rng.choice([1, 1, 3, 5])
            tokens = [rng.randrange(VOCAB) for _ in range(width)]
            parents = [-1, 0, 0, 1, 2][:width] if width == 5 and seq == "b" else None
            rows.append(RowInput(seq, tokens, num_logits=width, parents=parents))
        outputs = [runner.forward(rows) for runner in (eager, graphed)]
        torch.testing.assert_close(outputs[1].logits, outputs[0].logits, atol=1e-5, rtol=1e-5)
        for b, row in enumerate(rows):  # a row's states are valid for its own tokens, not the batch's padding
            n = len(row.token_ids)
            torch.testing.assert_close(outputs[1].hidden_states[b, :n], outputs[0].hidden_states[b, :n],
                                       atol=1e-5, rtol=1e-5)
        for row in rows:  # keep 1 + a few of the fed tokens, as a verify step does
            for runner in (eager, graphed):
                start = runner.length(row.seq_id) - len(row.token_ids)
                if row.parents is not None:
                    runner.keep_path(row.seq_id, start, [0, 1, 3])
                else:
                    runner.truncate(row.seq_id, start + 1 + step % len(row.token_ids))
    assert max(graphed.length(s) for s in prompts) > MIN_SPAN  # crossed into the second span bucket
    assert backend.replays > 0 and backend.captures == len(graphed.graphs) > 1
    prefill_graphs = {shape for shape in graphed.graphs._graphs if shape[1] >= 64}
    assert len(prefill_graphs) == (2 if max_width == 512 else 0)  # (1, 256, 256) for 240 and 250, (1, 64, 256)
    assert not graphed.cache.keys[:, :, : graphed.cache.block_size].any()  # the padding went to the sink, not here
    if max_width == 512:  # the 256-token prefill graph left the ancestor table out; the verify graphs have one
        assert graphed.graphs._graphs[(1, 256, 256, None)].batch.ancestors.numel() == 0
        assert graphed.graphs._graphs[(4, 5, 256, None)].batch.ancestors.shape == (4, 5, 5)


def test_every_width_a_token_tree_can_have_is_one_whose_graph_takes_trees():
    """A tree of up to MAX_SPECULATIVE_TOKENS nodes and the committed token, padded to its width bucket, fits a
    graph that carries the ancestor table; a tree in a wider forward is refused, not silently read as a chain."""
    assert width_bucket(MAX_SPECULATIVE_TOKENS + 1) <= TREE_CAPABLE_WIDTH < width_bucket(TREE_CAPABLE_WIDTH + 1)
    runner = make_runner(tiny_llama())
    runner.add_sequence("t")
    with pytest.raises(ValueError, match="token tree"):
        build_forward_batch(runner.cache, [RowInput("t", [1, 2, 3], 3, parents=[-1, 0, 0])], [0],
                            torch.device("cpu"), shape=(1, 2 * TREE_CAPABLE_WIDTH, MIN_SPAN))


def test_a_changed_forward_is_captured_again():
    """Serving other layers changes what the forward computes: the graphs of the old one are dropped."""
    runner, backend = with_rerun_graphs(tiny_llama())
    runner.add_sequence("a")
    runner.forward([RowInput("a", list(range(12)), num_logits=1)])
    runner.forward([RowInput("a", [5], num_logits=1)])
    assert len(runner.graphs) == 1
    runner.remove_sequence("a")
    runner.serve_hidden_layers([0, -1])
    assert len(runner.graphs) == 0
    runner.add_sequence("a")
    runner.forward([RowInput("a", list(range(12)), num_logits=1)])
    out = runner.forward([RowInput("a", [5], num_logits=1)])
    assert out.hidden_states.shape[-1] == 2 * runner.model.config.hidden_size and len(runner.graphs) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures real CUDA graphs")
def test_cuda_graphs_match_the_eager_forward():
    model = tiny_llama().to("cuda")
    eager = make_runner(model, graphs=GraphSettings(enforce_eager=True))
    graphed = make_runner(model)
    assert eager.graphs is None and graphed.graphs is not None
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(70)]  # one prompt for both runners
    for runner in (eager, graphed):
        runner.add_sequence("a")
        runner.add_sequence("b")
        runner.forward([RowInput("a", prompt), RowInput("b", [1, 2, 3])])
    for _ in range(6):
        rows = [RowInput("a", [rng.randrange(VOCAB) for _ in range(4)], num_logits=4), RowInput("b", [7], num_logits=1)]
        outputs = [runner.forward(rows) for runner in (eager, graphed)]
        torch.testing.assert_close(outputs[1].logits, outputs[0].logits, atol=1e-4, rtol=1e-4)
    assert len(graphed.graphs) == 2  # the prefill chunk's (2 rows x 128 tokens) and the steps' (2 x 5)


class RefusesToCapture(RerunOnReplay):
    def capture(self, forward):
        self.captures += 1
        forward()  # the warm-up ran, as on a GPU, before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_shape_that_cannot_be_captured_runs_eagerly_and_is_not_tried_again():
    model = tiny_llama()
    eager = make_runner(model)
    graphed = make_runner(model)
    backend = RefusesToCapture()
    graphed.graphs = StepGraphs(graphed._body, backend, (1, 2), graphed.device, max_width=4)
    for runner in (eager, graphed):
        runner.add_sequence("a")
        runner.forward([RowInput("a", list(range(20)), num_logits=1)])
    for token in (3, 9, 4):
        outputs = [runner.forward([RowInput("a", [token], num_logits=1)]) for runner in (eager, graphed)]
        torch.testing.assert_close(outputs[1].logits, outputs[0].logits, atol=1e-5, rtol=1e-5)
    assert backend.captures == 1 and len(graphed.graphs) == 0


async def test_through_the_engine_graph_shaped_steps_keep_greedy_output_with_chains_and_trees():
    """The engine over a runner whose decode and verify forwards take the graph path: mixed prefill and decode
    steps, trees with duplicate siblings, rollbacks and slots reused; greedy output equals the eager runner's
    without speculation."""
    from services.verifier.engine import Engine
    from services.verifier.engine_config import EngineConfig
    from services.verifier.sampling_params import SpeculationParams
    from tests.engine_harness import run_schedule
    from tests.proposers import OracleProposer, TreeProposer
    from tests.prompts import random_workload
    from tests.unit.test_engine_greedy import build_schedule, greedy_baseline

    model = tiny_llama(seed=3)
    n = 6
    prompts, max_tokens = random_workload(11, n, (3, 40), (5, 30))
    baseline = await greedy_baseline(model, prompts, max_tokens)
    references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(n)}
    runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=160)
    backend = RerunOnReplay()
    runner.graphs = StepGraphs(runner._body, backend, (1, 2, 4), runner.device, max_width=8)
    proposers = {"tree": TreeProposer(VOCAB, seed=1, references=references), "oracle": OracleProposer(references)}
    specs = [SpeculationParams(("tree", "oracle", None)[i % 3], 4 if i % 3 < 2 else 0) for i in range(n)]
    engine = Engine(runner, EngineConfig(max_num_batched_tokens=24, log_stats_interval_s=0,
                                         adaptive_speculation=False), proposers, eos_token_ids=())
    graphed = await run_schedule(engine, build_schedule(specs, prompts, max_tokens))
    for i in range(n):
        assert graphed[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"r{i} ({specs[i]})"
    assert backend.replays > 10 and len(runner.graphs) > 1


def test_a_forward_is_priced_at_the_shape_its_graph_runs():
    """padded_shape: where a graph replays a forward, its rows, width and span as the graph pads them; eagerly
    (no graphs, a width past them), the shape itself. The engine's step-cost model prices widths by it."""
    from services.verifier.step_cost import StepCostModel, StepShape

    eager = make_runner(tiny_llama(seed=3))
    assert eager.padded_shape(3, 6, 100) == (3, 6, 100)
    runner, _ = with_rerun_graphs(tiny_llama(seed=3), sizes=(1, 2, 4), max_width=16)
    assert runner.padded_shape(3, 6, 100) == (4, 9, MIN_SPAN)
    assert runner.padded_shape(1, 1, 300) == (1, 1, 512)
    assert runner.padded_shape(3, 17, 100) == (3, 17, 100)  # wider than its graphs: eager
    assert runner.padded_shape(5, 2, 100) == (5, 2, 100)  # more rows than its largest size: eager
    model = StepCostModel.for_runner(runner)
    assert model.padded(StepShape(3, 6, 100)) == StepShape(4, 9, 100)  # the span kept: step_cost.py
    assert StepCostModel.for_runner(object()).padded(StepShape(3, 6, 100)) == StepShape(3, 6, 100)
