"""Token trees through the engine: greedy output identical to no speculation (random trees, trees holding the
true continuation on a later branch, beside chains), sampled output following the target's distribution with
trees, and a malformed tree dropped rather than trusted."""

from __future__ import annotations

import random

from services.common.proposer import Draft
from services.modeling.generic_runner import GenericRunner
from services.verifier.draft_collection import NO_DRAFT, DraftCollector, ProposedDraft
from services.common.token_trees import leaf_paths
from services.verifier.draft_trees import verify_lines
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.speculation_planner import SpeculationPlanner
from services.verifier.step_cost import StepCostModel
from services.verifier.tree_budget import best_nodes, keep_nodes, node_gains
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import random_workload, repetitive_prompt
from tests.proposers import ModelSamplingTreeProposer, OracleProposer, TreeProposer
from tests.stats import ALPHA, chi_square_p_value, total_variation
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2
from tests.unit.test_engine_distribution import V, exact_joint, sample_pairs
from tests.step_costs import FixedCost
from tests.unit.test_engine_greedy import build_schedule, greedy_baseline, make_engine


def test_paths_and_lines():
    assert leaf_paths([-1, 0, 0, 1, -1]) == [[0, 1, 3], [0, 2], [4]]
    tree = ProposedDraft([7, 8, 9], None, [-1, -1, 1])
    lines = verify_lines([tree, NO_DRAFT, tree.first_path()])
    assert [(line.state, line.fed, line.tokens) for line in lines] == [
        (0, [0, 1], [7]), (0, [0, 2, 3], [8, 9]), (1, [0], []), (2, [0, 1], [7])]


def test_a_malformed_tree_is_dropped_and_a_chain_shaped_one_is_a_chain():
    collector = DraftCollector({}, VOCAB, 1.0)
    assert collector._sanitize(Draft([1, 2, 3], parents=[-1, 2, 0]), 3, True) == NO_DRAFT  # a parent after its child
    assert collector._sanitize(Draft([1, 2], parents=[-1]), 2, True) == NO_DRAFT  # too few parents
    assert collector._sanitize(Draft([1, 2, 3], parents=[-1, 0, 1]), 3, True) == ProposedDraft([1, 2, 3], None, None)
    assert collector._sanitize(Draft([1, 2, 3], parents=[-1, -1, 0]), 2, True) == ProposedDraft([1, 2], None, [-1, -1])


def test_a_tree_from_a_proposer_that_does_not_declare_trees_is_cut_to_its_first_path():
    collector = DraftCollector({}, VOCAB, 1.0)
    tree = Draft([1, 2, 3, 4], parents=[-1, -1, 1, 0])  # paths [1, 4], [2, 3]
    assert collector._sanitize(tree, 4, False) == ProposedDraft([1, 4], None, None)
    assert collector._sanitize(tree, 4, True) == ProposedDraft([1, 2, 3, 4], None, [-1, -1, 1, 0])


def test_path_probabilities_are_kept_only_when_each_node_has_a_probability():
    collector = DraftCollector({}, VOCAB, 1.0)
    tree = Draft([1, 2, 3], parents=[-1, -1, 0], path_probs=[0.5, 0.25, 0.125, 0.9])
    assert collector._sanitize(tree, 3, True).path_probs == [0.5, 0.25, 0.125]
    for bad in ([0.5, 0.25], [0.5, float("nan"), 0.1], [0.5, 1.5, 0.1], [-0.1, 0.2, 0.1]):
        cut = collector._sanitize(Draft([1, 2, 3], parents=[-1, -1, 0], path_probs=bad), 3, True)
        assert cut.parents == [-1, -1, 0] and cut.path_probs is None, bad
    assert collector._sanitize(Draft([1, 2], parents=[-1, 0], path_probs=[0.5, 0.2]), 2, True).path_probs is None


def test_a_q_tree_keeps_its_q_and_loses_its_path_probabilities():
    """A q-tree is cut by depth and order only (its path probabilities would rank siblings by their own tokens);
    a q that is not a finite, non-negative row per node makes it a plain tree; its first path keeps its rows."""
    import torch

    collector = DraftCollector({}, VOCAB, 1.0)
    q = torch.softmax(torch.randn(3, VOCAB), dim=-1)
    tree = collector._sanitize(Draft([1, 2, 3], q, parents=[-1, -1, 0], path_probs=[0.5, 0.25, 0.1]), 3, True)
    assert tree.parents == [-1, -1, 0] and tree.path_probs is None and torch.equal(tree.probs, q)
    assert torch.equal(tree.first_path().probs, q[[0, 2]])
    for bad in (q[:2], q.clone().fill_(float("nan")), -q, q[:, :-1]):
        plain = collector._sanitize(Draft([1, 2, 3], bad, parents=[-1, -1, 0], path_probs=[0.5, 0.25, 0.1]), 3, True)
        assert plain.probs is None and plain.path_probs == [0.5, 0.25, 0.1]


async def test_greedy_output_with_trees_equals_no_speculation():
    rng = random.Random(5)
    for model in (tiny_llama(seed=3), tiny_qwen2(seed=4)):
        n = 8
        prompts = [repetitive_prompt(rng, rng.randint(3, 40)) for _ in range(n)]
        max_tokens = [rng.randint(5, 40) for _ in range(n)]
        baseline = await greedy_baseline(model, prompts, max_tokens)
        references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(n)}
        proposers = {"tree": TreeProposer(VOCAB, seed=1, references=references),
                     "random_tree": TreeProposer(VOCAB, seed=2), "oracle": OracleProposer(references)}
        proposers["random_tree"].method = "random_tree"
        for k in (1, 3, 6):
            specs = [SpeculationParams(("tree", "random_tree", "oracle")[i % 3], k) for i in range(n)]
            speculative = await run_schedule(make_engine(model, proposers), build_schedule(specs, prompts, max_tokens))
            for i in range(n):
                assert speculative[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"K={k} r{i} ({specs[i]})"
            tree_rows = [speculative[f"r{i}"].outputs[-1].spec for i in range(n) if specs[i].method == "tree"]
            if k > 1:  # the true branch, placed after the random ones, was found and accepted: k // 2 a step
                drafts = sum(spec.num_drafts for spec in tree_rows)
                assert sum(spec.num_accepted_tokens for spec in tree_rows) >= 0.8 * (k // 2) * drafts > 0


async def test_adaptive_speculation_cuts_trees_and_keeps_the_output():
    """Under a steep CPU cost shape the planner verifies a few nodes of each 8-node tree, ranked by the drafter's
    path probabilities or not (which nodes: test_tree_budget.py); greedy output equals no speculation either way."""
    model = tiny_llama(seed=3)
    rng = random.Random(8)
    n = 4
    prompts = [repetitive_prompt(rng, rng.randint(10, 30)) for _ in range(n)]
    max_tokens = [30] * n
    baseline = await greedy_baseline(model, prompts, max_tokens)
    references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(n)}
    for ranked in (True, False):
        proposer = TreeProposer(VOCAB, seed=1, references=references, ranked=ranked)
        engine = make_engine(model, {"tree": proposer}, adaptive=True)
        engine.planner.cost = FixedCost(per_token=0.004)
        nodes = []  # per decode row of each forward: the draft tokens fed
        forward = engine.runner.forward
        engine.runner.forward = lambda rows: nodes.extend(len(r.token_ids) - 1 for r in rows) or forward(rows)
        out = await run_schedule(engine, build_schedule([SpeculationParams("tree", 8)] * n, prompts, max_tokens))
        for i in range(n):
            assert out[f"r{i}"].tokens == baseline[f"r{i}"].tokens, (ranked, i)
        cut = sum(1 for k in nodes if 0 < k < 8)
        assert cut > 0.3 * sum(1 for k in nodes if 0 < k <= 8), (ranked, nodes)
        assert engine.stats.num_accepted_tokens > 0


async def test_a_runner_without_trees_verifies_the_first_path():
    model = tiny_llama(seed=3)
    prompt = (1, 2, 3, 1, 2, 3, 1)
    plain = Engine(GenericRunner(model, 2, 64), EngineConfig(log_stats_interval_s=0, adaptive_speculation=False), {},
                   eos_token_ids=())
    def request(spec):
        return {0: [GenerationRequest("a", prompt, SamplingParams(max_tokens=12, temperature=0.0), spec)]}

    baseline = await run_schedule(plain, request(SpeculationParams()))
    proposer = TreeProposer(VOCAB, seed=3, references={"a": prompt + tuple(baseline["a"].tokens)})
    engine = Engine(GenericRunner(model, 2, 64), EngineConfig(log_stats_interval_s=0, adaptive_speculation=False),
                    {"tree": proposer}, eos_token_ids=())
    speculative = await run_schedule(engine, request(SpeculationParams("tree", 4)))
    assert speculative["a"].tokens == baseline["a"].tokens and proposer.calls > 0


async def test_sampled_output_with_trees_follows_the_target():
    target = tiny_llama(seed=21, vocab_size=V)
    params = SamplingParams(temperature=0.9)
    proposer = TreeProposer(V, seed=7)
    joint, engine = await sample_pairs(target, params, SpeculationParams("tree", 4), {"tree": proposer})
    assert engine.stats.num_drafts > 0 and engine.stats.num_accepted_tokens > 0
    expected = exact_joint(target, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
    # negative control: the same samples against another temperature's joint
    assert chi_square_p_value(joint, exact_joint(target, SamplingParams(temperature=0.6))) < ALPHA


class RandomTreeCuts(SpeculationPlanner):
    """Cuts each tree to a random number of nodes, 0 included, with the adaptive planner's own rule (tree_budget.py)."""

    def __init__(self, seed: int) -> None:
        super().__init__(StepCostModel(), adaptive=False)
        self.rng = random.Random(seed)
        self.kept: set[int] = set()

    def choose_drafts(self, decode, drafts, backlog=None):
        out = []
        for draft in drafts:
            k = self.rng.randint(0, len(draft.tokens))
            self.kept.add(k)
            out.append(keep_nodes(draft, best_nodes(node_gains(draft, [0.9, 0.6, 0.3]), k)) if draft.parents else draft)
        return out


async def test_sampled_q_trees_follow_the_target_and_are_accepted_more_with_q():
    """A drafter that samples its trees and sends q (multi-draft rejection, tree_rejection.py; q far from the
    target there too): sampled output follows the target; the same trees without q (the deterministic rule) are
    accepted less often; a drafter whose q is not what it drew from is caught (the test's power)."""
    target = tiny_llama(seed=21, vocab_size=V)
    params = SamplingParams(temperature=0.9)
    expected = exact_joint(target, params)
    spec = SpeculationParams("qtree", 6)
    with_q = ModelSamplingTreeProposer(target, 0.9, branch=2, send_q=True, seed=3)
    joint, engine = await sample_pairs(target, params, spec, {"qtree": with_q})
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
    accepted_with_q = engine.stats.num_accepted_tokens / engine.stats.num_drafts
    without_q = ModelSamplingTreeProposer(target, 0.9, branch=2, send_q=False, seed=3)
    _, engine = await sample_pairs(target, params, spec, {"qtree": without_q}, samples=500)
    assert accepted_with_q > 1.5 * engine.stats.num_accepted_tokens / engine.stats.num_drafts > 0
    # the planner's cuts (tree_budget.py, random budgets) keep a q-tree lossless
    cutting = ModelSamplingTreeProposer(tiny_llama(seed=22, vocab_size=V), 0.9, branch=3, send_q=True, seed=4)
    planner = RandomTreeCuts(seed=5)
    joint, engine = await sample_pairs(target, params, SpeculationParams("qtree", 8), {"qtree": cutting},
                                       planner=planner, samples=2000, max_tokens=8)  # room for trees two deep
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
    assert len(planner.kept) > 3 and engine.stats.num_accepted_tokens > 0
    liar = ModelSamplingTreeProposer(target, 0.9, branch=2, send_q=True, seed=3, drawn_from=5.0)
    joint, _ = await sample_pairs(target, params, spec, {"qtree": liar}, samples=500)
    assert chi_square_p_value(joint, expected) < ALPHA


async def test_greedy_output_with_q_trees_equals_no_speculation():
    """Greedy rows verify q-trees by the deterministic rule (q is for sampled rows)."""
    model = tiny_llama(seed=3)
    n = 4
    prompts, max_tokens = random_workload(6, n, (5, 30), (5, 30))
    baseline = await greedy_baseline(model, prompts, max_tokens)
    proposer = ModelSamplingTreeProposer(model, 1.0, branch=2, send_q=True, seed=1)
    engine = make_engine(model, {"qtree": proposer})
    out = await run_schedule(engine, build_schedule([SpeculationParams("qtree", 5)] * n, prompts, max_tokens))
    for i in range(n):
        assert out[f"r{i}"].tokens == baseline[f"r{i}"].tokens, i
    assert engine.stats.num_accepted_tokens > 0


async def test_ngram_trees_keep_greedy_output_and_sampled_distribution():
    """The ngram drafter's trees (the continuations of every match of its n-gram) through the engine: greedy output
    identical to no speculation, with drafts accepted on repetitive text; sampled output follows the target."""
    from services.drafter.methods.ngram import NgramProposer, NgramSettings

    model = tiny_llama(seed=3)
    n = 6
    prompts, max_tokens = random_workload(11, n, (10, 40), (10, 40))
    baseline = await greedy_baseline(model, prompts, max_tokens)
    engine = make_engine(model, {"ngram": NgramProposer(NgramSettings(1, 3), tree_depth=4)})
    speculative = await run_schedule(engine, build_schedule([SpeculationParams("ngram", 10)] * n, prompts, max_tokens))
    for i in range(n):
        assert speculative[f"r{i}"].tokens == baseline[f"r{i}"].tokens, i
    assert engine.stats.num_accepted_tokens > 0
    target = tiny_llama(seed=21, vocab_size=V)
    params = SamplingParams(temperature=0.9)
    joint, engine = await sample_pairs(target, params, SpeculationParams("ngram", 6),
                                       {"ngram": NgramProposer(NgramSettings(1, 2), tree_depth=3)})
    assert engine.stats.num_drafts > 0
    expected = exact_joint(target, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)
