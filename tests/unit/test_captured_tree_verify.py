"""A token tree's verification inside the step's graph (captured_tree_verify.py) emits what the eager tree
verification emits (draft_trees.py: each root-to-leaf path verified as a chain, the one that confirms the most
kept), and keeps the same path's K/V. On CPU the graphs replay by running the forward and its tail again
(tests/unit/test_step_graphs.py's backend)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.common.token_trees import tree_depths
from services.verifier import captured_verify
from services.verifier.captured_tree_verify import TreeVerifyTail
from services.verifier.draft_collection import ProposedDraft
from services.verifier.draft_trees import best_lines, line_length_through, verify_lines
from services.verifier.logits_processing import processed_log_probs
from services.verifier.random_streams import seed_to_int64
from services.verifier.rejection import coupled_samples, verify
from services.verifier.request_state import RequestState
from services.verifier.sampling_batch import SamplingBatch
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import random_workload
from tests.proposers import OracleProposer, TreeProposer
from tests.tiny_models import VOCAB, tiny_llama
from tests.unit.test_captured_verify import eager_runner, full_k_engine, graphed_runner, in_pairs


def random_tree(rng: random.Random, nodes: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(nodes)]


def eager_outcome(logits: torch.Tensor, drafts: list[ProposedDraft], params: list[SamplingParams], seeds: list[int],
                  positions: list[int]) -> list[tuple[list[int], int, list[int], int]]:
    """What the eager path (step_execution.execute) emits, accepts, keeps and reports as verified for each row: its
    lines verified as chains."""
    lines = verify_lines(drafts)
    k = max(len(line.tokens) for line in lines)
    gathered = torch.stack([logits[line.state, line.fed + [line.fed[-1]] * (k + 1 - len(line.fed))] for line in lines])
    device = logits.device
    batch = SamplingBatch.build([params[line.state] for line in lines], [seeds[line.state] for line in lines], VOCAB,
                                device)
    padded = [line.tokens + [0] * (k - len(line.tokens)) for line in lines]
    result = verify(gathered, torch.tensor(padded, device=device),
                    torch.tensor([len(line.tokens) for line in lines], device=device),
                    torch.tensor([positions[line.state] for line in lines], device=device), batch)
    accepted = result.num_accepted.tolist()
    outcomes = []
    for r in best_lines(lines, accepted, len(drafts)):
        n = accepted[r]
        outcomes.append((result.tokens[r, : n + 1].tolist(), n, lines[r].fed[: n + 1], len(lines[r].tokens)))
    return outcomes


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_tree_tail_emits_and_keeps_what_the_eager_tree_verification_does(sampled):
    """Random trees of 0..7 nodes (and a chain), their nodes the target's own picks often enough that paths are
    accepted several deep, padded to 8 rows of width 8, against every root-to-leaf path verified as a chain."""
    rng = random.Random(3)
    width, rows = 8, 6
    for trial in range(20):
        logits = torch.randn(rows, width, VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        params = [SamplingParams(temperature=0.0 if (b % 2 == 0 or not sampled) else 0.6 + 0.1 * b)
                  for b in range(rows)]
        seeds = [seed_to_int64(rng.randrange(-2**63, 2**64)) for _ in range(rows)]
        positions = [rng.randrange(1, 100) for _ in range(rows)]
        parents = [random_tree(rng, rng.randrange(1, width)) for _ in range(rows)]
        parents[0] = list(range(-1, width - 2))  # a chain among the trees
        batch = SamplingBatch.build(params, seeds, VOCAB, torch.device("cpu"))
        fed_depth = torch.tensor([[0] + [d + 1 for d in tree_depths(p)] + [0] * (width - 1 - len(p)) for p in parents])
        log_p = processed_log_probs(logits, batch, torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows))
        picks = coupled_samples(log_p, torch.tensor(positions)[:, None] + fed_depth, batch).tolist()
        drafts = []
        for b, tree in enumerate(parents):
            tokens: list[int] = []
            for parent in tree:  # the target's pick after the parent, unless a sibling has it: then another token
                siblings = [t for t, p in zip(tokens, tree, strict=False) if p == parent]
                pick = picks[b][parent + 1]
                tokens.append(pick if rng.random() < 0.7 and pick not in siblings
                              else rng.choice([t for t in range(VOCAB) if t not in siblings and t != pick]))
            drafts.append(ProposedDraft(tokens, None, parents=None if b == 0 else tree))
        expected = eager_outcome(logits, drafts, params, seeds, positions)

        tail = TreeVerifyTail(sampled=sampled, tokens=tuple(tuple(d.tokens) for d in drafts),
                              parents=tuple(tuple(p) for p in parents), positions=tuple(positions),
                              seeds=tuple(seeds), greedy=tuple(p.greedy for p in params),
                              temperatures=tuple(1.0 if p.greedy else p.temperature for p in params))
        graph_logits = torch.randn(8, width, VOCAB)  # padding rows hold anything
        graph_logits[:rows] = logits
        out = tail.run(graph_logits, tail.inputs(8, width))
        assert out.shape == (8, 2 * width)
        got = []
        for tree, row in zip(parents, out[:rows].tolist(), strict=True):
            emitted, n, kept_fed = TreeVerifyTail.read(row)
            got.append((emitted, n, kept_fed, line_length_through(tree, [fed - 1 for fed in kept_fed[1:]])))
        assert got == expected, trial
    assert max(n for _, n, _, _ in expected) >= 2  # paths were accepted deep, not only at the root


def test_which_tree_steps_the_tail_takes():
    def state():
        request = GenerationRequest("r", (1, 2), SamplingParams(temperature=0.0))
        return RequestState(request=request, seed=0, token_ids=[1, 2], outputs=asyncio.Queue())

    tree = ProposedDraft([3, 4, 3], None, parents=[-1, -1, 0])
    repeated = ProposedDraft([3, 3], None, parents=[-1, -1])  # two root children of one token
    assert captured_verify.takes([state()], [tree], VOCAB)
    assert not captured_verify.takes([state()], [repeated], VOCAB)
    assert isinstance(captured_verify.tail_for([state(), state()], [ProposedDraft([5], None), tree]), TreeVerifyTail)
    assert not isinstance(captured_verify.tail_for([state()], [ProposedDraft([5], None)]), TreeVerifyTail)


def test_tree_graphs_are_captured_ahead_where_a_drafter_sends_trees():
    runner, _ = graphed_runner(tiny_llama())
    runner.capture_graphs(3, captured_verify.prototypes(trees=True))
    assert {key[3] for key in runner.graphs._graphs} == {None, ("verify", False), ("verify", True),
                                                          ("verify-tree", False), ("verify-tree", True)}


async def test_through_the_engine_tree_steps_verify_in_the_graph_and_output_is_unchanged():
    """Trees with the reference continuation as one branch (accepted, its K/V moved into place) and random ones,
    greedy and seeded sampled requests: every output equals the eager runner's with the same drafter and the
    output without speculation; most tree steps verified in the graph, and those whose siblings repeat a token
    took the eager path."""
    model = tiny_llama(seed=3)
    n = 6
    prompts, max_tokens = random_workload(8, n, (3, 30), (8, 24))

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens[i], **(dict(temperature=0.0) if i % 2 == 0
                                                          else dict(temperature=0.9, seed=5 + i)))

    baseline = await run_schedule(full_k_engine(eager_runner(model), {}),
                                  in_pairs(prompts, sampling, [SpeculationParams()] * n))
    references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(n)}

    def proposers():
        return {"tree": TreeProposer(VOCAB, seed=1, references=references, duplicate_share=0.0),
                "repeating": TreeProposer(VOCAB, seed=2, references=references),
                "oracle": OracleProposer(references)}

    methods = ["tree", "tree", "repeating", "tree", "oracle", "tree"]
    specs = [SpeculationParams(m, 3 + i % 4) for i, m in enumerate(methods)]
    runner, _ = graphed_runner(model)
    tree_steps, forward_with_tail = [0], runner.forward_with_tail

    def counting(rows, tail, *launched):  # the steps a tree was verified in the graph
        out = forward_with_tail(rows, tail, *launched)
        tree_steps[0] += out is not None and any(row.parents is not None for row in rows)
        return out

    runner.forward_with_tail = counting
    graphed = await run_schedule(full_k_engine(runner, proposers()), in_pairs(prompts, sampling, specs))
    eager = await run_schedule(full_k_engine(eager_runner(model), proposers()), in_pairs(prompts, sampling, specs))
    for i in range(n):
        assert graphed[f"r{i}"].tokens == eager[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"r{i} {methods[i]}"
        # and what each step verified and accepted, which the planner and the metrics read
        assert [o.spec for o in graphed[f"r{i}"].outputs] == [o.spec for o in eager[f"r{i}"].outputs], f"r{i}"
    tails = {key[3] for key in runner.graphs._graphs}
    assert {("verify-tree", False), ("verify-tree", True)} <= tails, tails
    assert tree_steps[0] >= 5, tree_steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures real CUDA graphs")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_cuda_graph_tree_tails_emit_and_keep_what_the_eager_path_does(sampled):
    """A real CUDA graph with a tree's verification in it, against the eager forward of the same tree and its lines
    verified as chains on the same GPU (float32), over steps whose trees are accepted some way or not at all, and
    the K/V of the kept path: the next step's logits agree."""
    from services.modeling.llama_runner import LlamaFamilyRunner
    from services.modeling.runner import RowInput
    from services.modeling.step_graphs import GraphSettings
    from services.verifier.draft_trees import fed_parents

    model = tiny_llama(seed=3).to("cuda")
    eager = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=160, graphs=GraphSettings(enforce_eager=True))
    graphed = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=160)
    assert graphed.capture_graphs(5, captured_verify.prototypes(trees=True)) > 0
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(30)]
    for runner in (eager, graphed):
        runner.add_sequence("a")
        runner.forward([RowInput("a", prompt)])
    last = prompt[-1]
    params = SamplingParams(temperature=0.9 if sampled else 0.0)
    for step in range(8):
        position = eager.length("a") + 1
        probe = eager.forward([RowInput("a", [last], num_logits=1)]).logits  # the target's next pick, to draft it
        eager.truncate("a", position - 1)
        parents = [-1, -1, 0, 2] if step % 2 else [-1, 0, 0]
        first = int(probe[0, -1].argmax())
        tokens = [first if step % 3 else (first + 1) % VOCAB] + [
            t for t in rng.sample(range(VOCAB), len(parents)) if t != first][: len(parents) - 1]
        draft = ProposedDraft(tokens, None, parents=parents)
        row = RowInput("a", [last, *tokens], num_logits=1 + len(tokens), parents=fed_parents(parents))
        tail = TreeVerifyTail(sampled=sampled, tokens=(tuple(tokens),), parents=(tuple(parents),),
                              positions=(position,), seeds=(11,), greedy=(params.greedy,),
                              temperatures=(1.0 if params.greedy else params.temperature,))
        replayed = graphed.forward_with_tail([row], tail)
        assert replayed is not None
        emitted, n, kept_fed = TreeVerifyTail.read(replayed[0][0].tolist())
        logits = eager.forward([row]).logits
        assert (emitted, n, kept_fed) == eager_outcome(logits, [draft], [params], [11], [position])[0][:3]
        for runner in (eager, graphed):
            runner.keep_path("a", position - 1, kept_fed)
        last = emitted[-1]
    check = RowInput("a", [last], num_logits=1)
    assert torch.allclose(eager.forward([check]).logits, graphed.forward([check]).logits, atol=1e-4)
