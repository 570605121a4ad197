"""Verification captured in the step's graph (captured_verify.py) emits what the eager verification emits.

On CPU the graphs replay by running the forward and its tail again (tests/unit/test_step_graphs.py's backend), so
everything but the capture itself is what a GPU runs: the tail's inputs appended to the static buffer, rows padded
to a capture size and drafts to the graph's width, the LM head over every column, the accepted tokens read from
the graph's own output.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.common.proposer import ProposerCapabilities
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.runner import RowInput
from services.modeling.step_graphs import GraphSettings, StepGraphs
from services.verifier import captured_verify
from services.verifier.captured_verify import VerifyTail
from services.verifier.draft_collection import ProposedDraft
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.random_streams import seed_to_int64
from services.verifier.request_state import RequestState
from services.verifier.rejection import verify
from services.verifier.sampling_batch import SamplingBatch
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import random_workload
from tests.proposers import ModelSamplingProposer, OracleProposer, RandomProposer
from tests.tiny_models import VOCAB, tiny_llama
from tests.unit.test_step_graphs import RefusesToCapture, RerunOnReplay


def graphed_runner(model, backend=None, sizes=(1, 2, 4)) -> tuple[LlamaFamilyRunner, RerunOnReplay]:
    runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=160)
    backend = backend or RerunOnReplay()
    runner.graphs = StepGraphs(runner._body, backend, sizes, runner.device, max_width=8, head=runner._head)
    return runner, backend


def in_pairs(prompts, sampling, specs) -> dict[int, list[GenerationRequest]]:
    """The engine tests' schedule: requests two at a time, a pair every other step (run_schedule's steps)."""
    return {(i // 2) * 2: [GenerationRequest(f"r{j}", prompts[j], sampling(j), specs[j]) for j in (i, i + 1)]
            for i in range(0, len(specs), 2)}


def full_k_engine(runner, proposers) -> Engine:
    """An engine that verifies every row's full K (no adaptive planning), so that graphed and eager runs verify
    the same drafts."""
    config = EngineConfig(max_num_batched_tokens=24, log_stats_interval_s=0, adaptive_speculation=False)
    return Engine(runner, config, proposers, eos_token_ids=())


def eager_runner(model) -> LlamaFamilyRunner:
    return LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=160)


def count_tail_steps(runner: LlamaFamilyRunner) -> list[int]:
    """Counts the forwards that ran with their verification in the graph ([n], updated as the runner runs)."""
    counted, forward_with_tail = [0], runner.forward_with_tail

    def counting(rows, tail, *launched):
        out = forward_with_tail(rows, tail, *launched)
        counted[0] += out is not None
        return out

    runner.forward_with_tail = counting
    return counted


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_tail_emits_what_verify_emits(sampled):
    """Rows of 0..4 drafts, some matching the target's picks for a while, padded to 8 rows of width 9."""
    rng = random.Random(1)
    rows, width, k_max = 5, 9, 4
    logits = torch.randn(rows, k_max + 1, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(temperature=0.0 if (b % 2 == 0 or not sampled) else 0.7 + 0.1 * b) for b in range(rows)]
    seeds = [seed_to_int64(rng.randrange(-2**63, 2**64)) for _ in range(rows)]
    positions = [rng.randrange(1, 100) for _ in range(rows)]
    picks = logits.argmax(-1)
    drafts = [[int(t) for t in picks[b, :n]] for b, n in enumerate((0, 1, 3, 4, 4))]
    drafts[3][2] = (drafts[3][2] + 1) % VOCAB  # rejected at its third draft
    batch = SamplingBatch.build(params, seeds, VOCAB, torch.device("cpu"))
    padded = torch.tensor([d + [0] * (k_max - len(d)) for d in drafts])
    expected = verify(logits, padded, torch.tensor([len(d) for d in drafts]), torch.tensor(positions), batch)

    tail = VerifyTail(sampled=any(not p.greedy for p in params), drafts=tuple(map(tuple, drafts)),
                      positions=tuple(positions), seeds=tuple(seeds), greedy=tuple(p.greedy for p in params),
                      temperatures=tuple(1.0 if p.greedy else p.temperature for p in params))
    graph_logits = torch.randn(8, width, VOCAB)  # padding rows and columns hold anything
    graph_logits[:rows, : k_max + 1] = logits
    out = tail.run(graph_logits, tail.inputs(8, width))
    assert out.shape == (8, width + 1)
    for b in range(rows):
        accepted = int(expected.num_accepted[b])
        assert int(out[b, -1]) == accepted
        assert out[b, : accepted + 1].tolist() == expected.tokens[b, : accepted + 1].tolist()
    assert int(expected.num_accepted[1]) == 1 and int(expected.num_accepted[3]) == 2 or sampled


def test_which_steps_the_tail_takes():
    def state(**sampling):
        request = GenerationRequest("r", (1, 2), SamplingParams(**sampling))
        return RequestState(request=request, seed=0, token_ids=[1, 2], outputs=asyncio.Queue())

    chain, tree = ProposedDraft([3, 4], None), ProposedDraft([3, 4], None, parents=[-1, -1])
    with_q = ProposedDraft([3], torch.full((1, VOCAB), 1 / VOCAB))
    takes = captured_verify.takes
    assert takes([state(temperature=0.0), state(temperature=0.9, seed=3)], [chain, chain], VOCAB)
    assert takes([state(temperature=0.0)], [with_q], VOCAB)  # a greedy row never reads q
    assert takes([state(top_k=VOCAB, top_p=1.0)], [chain], VOCAB)  # filters that filter nothing
    for refused in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(logprobs=0), dict(presence_penalty=0.5),
                    dict(repetition_penalty=1.1)):
        assert not takes([state(temperature=0.0), state(**refused)], [chain, chain], VOCAB), refused
    assert not takes([state()], [with_q], VOCAB)
    assert takes([state()], [tree], VOCAB)  # a tree: captured_tree_verify's tail (test_captured_tree_verify.py)


def test_the_runner_runs_a_tail_only_where_a_graph_takes_it():
    model = tiny_llama(seed=3)
    runner, backend = graphed_runner(model, sizes=(1, 2))
    for seq in "abc":
        runner.add_sequence(seq)
        runner.forward([RowInput(seq, list(range(1, 12)))])
    tail = VerifyTail(sampled=False, drafts=((5,),), positions=(12,), seeds=(0,), greedy=(True,), temperatures=(1.0,))
    assert runner.forward_with_tail([RowInput("a", [4, 5], num_logits=2)], tail) is not None
    assert runner.length("a") == 13
    three = VerifyTail(sampled=False, drafts=((),) * 3, positions=(13, 11, 11), seeds=(0,) * 3, greedy=(True,) * 3,
                       temperatures=(1.0,) * 3)
    assert runner.forward_with_tail([RowInput(s, [4]) for s in "abc"], three) is None  # 3 rows > sizes (1, 2)
    assert runner.forward_with_tail([RowInput("b", [4, 5], 2, parents=[-1, -1])], tail) is None  # a tree
    assert [runner.length(s) for s in "abc"] == [13, 11, 11]  # nothing was fed by the refused calls

    refusing, _ = graphed_runner(model, backend=RefusesToCapture(), sizes=(1, 2))
    refusing.add_sequence("a")
    refusing.forward([RowInput("a", list(range(1, 12)))])  # eagerly, after the refused capture
    assert refusing.forward_with_tail([RowInput("a", [4, 5], num_logits=2)], tail) is None
    assert refusing.length("a") == 11


def test_graphs_with_tails_are_captured_ahead():
    runner, backend = graphed_runner(tiny_llama())
    shapes = 3 * 4  # sizes 1, 2, 4 by widths 1, 2, 3, 5
    assert runner.capture_graphs(5, captured_verify.prototypes(trees=False)) == 3 * shapes
    assert runner.capture_graphs(5, captured_verify.prototypes(trees=False)) == 0
    assert {key[3] for key in runner.graphs._graphs} == {None, ("verify", False), ("verify", True)}
    assert not runner.cache.keys[:, :, : runner.cache.block_size].any()  # the padding went to the sink


class DeclaresItsWidth(RandomProposer):
    """A drafter that declares the most tokens it answers (a remote drafter's Info does: a tree's node count)."""

    def __init__(self, most: int) -> None:
        super().__init__(VOCAB, seed=0)
        self.capabilities = ProposerCapabilities(max_speculative_tokens=most)


@pytest.mark.parametrize(("most", "widest"), [(0, 9), (4, 9), (24, 25)])
async def test_the_engine_captures_ahead_as_wide_as_its_drafters_answer(most, widest):
    """Before its first step the engine captures rows as wide as K = 8's verify, or as a drafter's widest answer
    plus its committed token where that is wider (a token tree of 24 nodes), so no step waits on such a capture."""
    runner, _ = graphed_runner(tiny_llama())
    asked = []
    capture = runner.capture_graphs
    runner.capture_graphs = lambda width, tails: asked.append(width) or capture(min(width, 5), tails)
    config = EngineConfig(max_num_batched_tokens=24, log_stats_interval_s=0)
    async with Engine(runner, config, {"wide": DeclaresItsWidth(most)}, eos_token_ids=()):
        pass
    assert asked == [widest]


async def test_through_the_engine_greedy_and_sampled_output_is_unchanged():
    """Greedy and seeded sampled requests with drafts that are right, wrong or random, beside requests whose
    steps take the eager tail (logprobs, top-p, a drafter's q): every output equals the eager runner's with the
    same drafters and, where drafts are deterministic, the output without speculation; many decode steps ran their
    verification in the graph."""
    model = tiny_llama(seed=3)
    n = 8
    prompts, max_tokens = random_workload(5, n, (3, 30), (6, 24))

    def sampling(i: int) -> SamplingParams:
        kinds = [dict(temperature=0.0), dict(temperature=0.8, seed=11 + i), dict(temperature=0.0),
                 dict(temperature=1.1, seed=7 * i), dict(temperature=0.0, logprobs=2),
                 dict(temperature=0.9, seed=3, top_p=0.8), dict(temperature=0.7, seed=i), dict(temperature=0.0)]
        return SamplingParams(max_tokens=max_tokens[i], **kinds[i])

    baseline = await run_schedule(full_k_engine(eager_runner(model), {}),
                                  in_pairs(prompts, sampling, [SpeculationParams()] * n))
    references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(n)}

    def proposers():
        return {"oracle": OracleProposer(references), "random": RandomProposer(VOCAB, seed=2),
                "q": ModelSamplingProposer(tiny_llama(seed=9), temperature=1.0, send_q=True, seed=4, method="q")}

    methods = ["oracle", "random", "oracle", "random", "oracle", "oracle", "q", "random"]
    specs = [SpeculationParams(m, 1 + i % 4) for i, m in enumerate(methods)]
    runner, backend = graphed_runner(model)
    tail_steps = count_tail_steps(runner)
    graphed = await run_schedule(full_k_engine(runner, proposers()), in_pairs(prompts, sampling, specs))
    eager = await run_schedule(full_k_engine(eager_runner(model), proposers()), in_pairs(prompts, sampling, specs))
    for i in range(n):
        assert graphed[f"r{i}"].tokens == eager[f"r{i}"].tokens, f"r{i} ({sampling(i)}, {methods[i]})"
        if methods[i] != "q":  # a sampled row with q follows the target's distribution, not its very tokens
            assert graphed[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"r{i} ({sampling(i)}, {methods[i]})"
    logprobs = [entry.logprob for output in graphed["r4"].outputs for entry in output.logprobs or ()]
    assert len(logprobs) == len(baseline["r4"].tokens)  # the eager tail served the request that asked
    tails = {key[3] for key in runner.graphs._graphs}
    assert {("verify", False), ("verify", True), None} <= tails, tails
    assert tail_steps[0] >= 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures real CUDA graphs")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_cuda_graph_tails_emit_what_the_eager_tail_emits(sampled):
    """A real CUDA graph with the verification in it, against the eager forward and verify on the same GPU (float32,
    so that the padded LM head cannot flip a pick), over steps that accept, reject and draft nothing."""
    model = tiny_llama(seed=3).to("cuda")
    eager = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=160, graphs=GraphSettings(enforce_eager=True))
    graphed = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=160)
    assert graphed.capture_graphs(5, captured_verify.prototypes(trees=False)) > 0
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(30)]
    for runner in (eager, graphed):
        for seq in "ab":
            runner.add_sequence(seq)
            runner.forward([RowInput(seq, prompt)])
    tokens = {"a": prompt[-1], "b": prompt[-1]}
    params = {"a": SamplingParams(temperature=0.0), "b": SamplingParams(temperature=0.9 if sampled else 0.0)}
    for step in range(8):
        drafts = {"a": [rng.randrange(VOCAB) for _ in range(step % 4)], "b": [rng.randrange(VOCAB)]}
        rows = [RowInput(s, [tokens[s], *drafts[s]], num_logits=1 + len(drafts[s])) for s in "ab"]
        position = {s: eager.length(s) + 1 for s in "ab"}
        tail = VerifyTail(sampled=sampled, drafts=tuple(tuple(drafts[s]) for s in "ab"),
                          positions=tuple(position[s] for s in "ab"), seeds=(1, 2),
                          greedy=tuple(params[s].greedy for s in "ab"),
                          temperatures=tuple(1.0 if params[s].greedy else params[s].temperature for s in "ab"))
        replayed = graphed.forward_with_tail(rows, tail)
        assert replayed is not None
        results = replayed[0][:2].tolist()
        logits = eager.forward(rows).logits
        k = logits.shape[1] - 1
        batch = SamplingBatch.build([params[s] for s in "ab"], [1, 2], VOCAB, torch.device("cuda"))
        padded = torch.tensor([drafts[s] + [0] * (k - len(drafts[s])) for s in "ab"], device="cuda")
        expected = verify(logits, padded, torch.tensor([len(drafts[s]) for s in "ab"], device="cuda"),
                          torch.tensor([position[s] for s in "ab"], device="cuda"), batch)
        for b, seq in enumerate("ab"):
            accepted = int(expected.num_accepted[b])
            assert results[b][-1] == accepted
            assert results[b][: accepted + 1] == expected.tokens[b, : accepted + 1].tolist()
            for runner in (eager, graphed):
                runner.truncate(seq, position[seq] + accepted)
            tokens[seq] = results[b][accepted]
