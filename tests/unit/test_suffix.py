"""The `suffix` drafter method over the real arctic-inference suffix tree (no mocks of it).

`make install` builds arctic-inference, so these tests fail (with MethodUnavailableError saying how to install
it) when it is missing. Only on a platform where `make install` warned that it could not build it, set
SPECSERVE_NO_SUFFIX=1 to skip this module.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

if os.environ.get("SPECSERVE_NO_SUFFIX") == "1":
    pytest.skip(
        "SPECSERVE_NO_SUFFIX=1: arctic-inference does not build on this platform", allow_module_level=True
    )

from services.common.drafter_methods import MethodUnavailableError, build_proposer
from services.common.proposer import DraftInput
from services.common.speculative_config import SpeculativeConfig
from services.common.token_trees import tree_depths
from services.drafter.methods.suffix import SuffixProposer, SuffixSettings
from services.drafter.server import serve
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from services.verifier.speculation_planner import SpeculationPlanner
from services.verifier.step_cost import StepCostModel
from tests.engine_harness import run_schedule
from tests.prompts import repetitive_prompt
from tests.stats import ALPHA, chi_square_p_value, total_variation
from tests.tiny_models import tiny_llama
from tests.unit.test_engine_distribution import V, exact_joint, sample_pairs

PROMPT = list(range(100, 130))  # 30 distinct tokens: longer than the default tree depth (24)
OUTPUT = list(range(200, 220))  # what request "A" generated


def proposer(**settings) -> SuffixProposer:
    return SuffixProposer(SuffixSettings(**settings))


async def draft(p: SuffixProposer, seq_id, token_ids, k: int = 5) -> list[int]:
    [result] = await p.propose([DraftInput(seq_id, list(token_ids), k)])
    assert result.probs is None
    return list(result.token_ids)


async def run_request(p: SuffixProposer, seq_id, prompt, output, k: int = 5) -> list[list[int]]:
    """Feed `p` as the engine does: first view prompt + output[0] (sampled at prefill), then one committed
    token per step (as if every draft were rejected); release at the end. Returns the drafts."""
    full = list(prompt) + list(output)
    drafts = [await draft(p, seq_id, full[:n], k) for n in range(len(prompt) + 1, len(full) + 1)]
    p.release(seq_id)
    return drafts


async def test_continues_a_repeated_pattern_within_a_request():
    p = proposer()
    pattern = [10, 11, 12, 13, 14]
    sequence = pattern * 3 + [10, 11]
    assert await draft(p, "a", sequence) == [12, 13, 14, 10, 11]
    sequence += [12, 13, 14]  # three committed: the next view extends the last
    assert await draft(p, "a", sequence, k=4) == [10, 11, 12, 13]
    # the most frequent continuation wins: 20 follows [1, 2] twice, 30 once
    assert await draft(p, "b", [1, 2, 20, 5, 1, 2, 30, 6, 1, 2, 20, 7, 1, 2], k=1) == [20]
    assert p.num_active == 2


async def test_a_finished_response_drafts_a_repeated_request_from_its_first_step():
    p = proposer()
    drafts_a = await run_request(p, "A", PROMPT, OUTPUT)
    assert drafts_a[0] == []  # nothing seen before: no draft
    assert p.num_active == 0 and p.num_cached_responses == 1
    # B has A's prompt and (greedy) A's first token: its first draft is A's output, K long
    assert await draft(p, "B", PROMPT + OUTPUT[:1]) == OUTPUT[1:6]
    assert await draft(p, "B", PROMPT + OUTPUT[:4]) == OUTPUT[4:9]
    # an unrelated request gets nothing from A until its context meets A's output
    assert await draft(p, "C", [1, 2, 3, 4]) == []
    assert await draft(p, "C", [1, 2, 3, 4, 205, 206]) == OUTPUT[7:9]  # 2 matched: 2 drafted (factor 1.0)


async def test_with_trees_two_continuations_seen_before_are_both_drafted():
    """num_draft_tokens set: the drafter sends the tree the match grows, both earlier continuations of the same
    context as branches; without it, only the best path."""
    other = [300, 301, 302, 303, 304]
    for trees in (True, False):
        p = proposer(trees=trees, min_token_prob=0.0, tree_depth=3)
        await run_request(p, "A", PROMPT, OUTPUT)
        await run_request(p, "B", PROMPT, [OUTPUT[0]] + other)  # same first token, then a continuation of its own
        [result] = await p.propose([DraftInput("C", PROMPT + OUTPUT[:1], 8)])
        tokens = list(result.token_ids)
        if not trees:
            assert result.parents is None and tokens in (OUTPUT[1:9], other)
            continue
        parents = list(result.parents)
        roots = [tokens[i] for i, parent in enumerate(parents) if parent == -1]
        assert sorted(roots) == [OUTPUT[1], other[0]], (tokens, parents)  # each seen once
        assert all(-1 <= parent < i for i, parent in enumerate(parents)) and len(tokens) <= 8
        assert max(tree_depths(parents)) == 2  # tree_depth 3: no path longer than 3 tokens


async def test_without_the_prompt_tail_in_the_global_tree_the_first_step_has_no_match():
    """vLLM's layout (only output tokens in the global tree): the first view, prompt + first token, is in the
    request's tree only, so a repeated request finds A's output only once its own output matches it."""
    p = proposer(global_context_tokens=0)
    await run_request(p, "A", PROMPT, OUTPUT)
    assert await draft(p, "B", PROMPT + OUTPUT[:1]) == []
    assert (
        await draft(p, "B", PROMPT + OUTPUT[:4]) == OUTPUT[4:7]
    )  # match length 2 (OUTPUT[2:4]) allows 2 * 1.0


async def test_a_view_that_does_not_extend_the_last_restarts_the_sequence():
    p = proposer()
    prompt = [1, 2, 3, 4, 5]
    await draft(p, "a", prompt + [1, 2, 77, 78])
    # rolled back and regenerated differently: position 7 is now 3, not 77
    regenerated = prompt + [1, 2, 3, 4, 5, 1, 2]
    assert await draft(p, "a", regenerated) == [3, 4, 5, 1, 2]
    assert p.num_active == 1 and p.num_cached_responses == 1  # the old view's response was dropped
    # a shorter view (a pure rollback), then one that changes only the last token
    assert await draft(p, "a", prompt + [1, 2]) == [3, 4]  # only this view is left: [1, 2] matched once
    assert await draft(p, "a", prompt + [1, 9]) == []
    assert await draft(p, "a", prompt + [1, 9, 3, 4, 5, 1]) == [9, 3, 4, 5]  # 4 matched
    # the dropped views left nothing in the global tree: no request finds the old [2, 77] -> 78 again
    assert await draft(p, "b", [0, 2, 77], k=8) == []
    assert p.num_cached_responses == 2
    # empty and one-token views are fine too
    assert await draft(p, "c", []) == []
    assert await draft(p, "c", [5]) == []
    p.release("c")
    p.release("never-seen")  # releasing an unknown sequence is a no-op


async def test_never_more_than_k():
    p = proposer()
    sequence = [7, 8, 9] * 30  # a long pattern: the tree could draft far more than K
    for k in (0, 1, 2, 3, 5, 8, 16, 64):
        tokens = await draft(p, "a", sequence, k)
        assert len(tokens) <= k
        assert tokens == ([7, 8, 9] * 30)[: len(tokens)]  # the pattern's continuation (sequence ends with 9)
    # a match and its draft fit in the tree depth (24): at factor 1.0 no draft is longer than 12
    assert len(await draft(p, "a", sequence, 16)) == 12
    assert len(await draft(p, "a", sequence, 8)) == 8
    assert await draft(p, "a", sequence, 0) == []
    # each input gets its own K in one batch
    drafts = await p.propose([DraftInput("a", sequence, 3), DraftInput("b", [1, 2, 1, 2, 1], 1)])
    assert [list(d.token_ids) for d in drafts] == [[7, 8, 9], [2]]


async def test_draft_length_follows_the_match_length_and_min_token_prob():
    p = proposer(max_spec_factor=0.5)
    await run_request(p, "A", PROMPT, OUTPUT)
    assert await draft(p, "B", [1, 2, 203, 204, 205, 206], k=8) == OUTPUT[7:9]  # 4 matched * 0.5
    # [1, 2] occurs 4 times (the last one is the context itself): 20 follows it with p = 2/4, then 5 or 7
    # with p = 2/4 * 1/2
    sequence = [1, 2, 20, 5, 1, 2, 30, 6, 1, 2, 20, 7, 1, 2]
    assert await draft(proposer(min_token_prob=0.4), "b", sequence, k=5) == [20]
    assert await draft(proposer(min_token_prob=0.6), "b", sequence, k=5) == []
    assert len(await draft(proposer(min_token_prob=0.2), "b", sequence, k=5)) == 2


async def test_the_global_cache_bound_evicts_the_oldest_response():
    # a slot is taken when a request starts, so with a bound of 1 B's start evicts A
    p = proposer(max_cached_requests=1)
    await run_request(p, "A", PROMPT, OUTPUT)
    assert await draft(p, "B", PROMPT + OUTPUT[:1]) == []
    assert p.num_cached_responses == 1
    # with room for two A survives B's start
    p = proposer(max_cached_requests=2)
    await run_request(p, "A", PROMPT, OUTPUT)
    assert await draft(p, "B", PROMPT + OUTPUT[:1]) == OUTPUT[1:6]

    async def after_three(first_prompt_of) -> list[int]:
        """A, B and C finish (bound 2: C's start evicts A); then D starts with the prompt of A or C."""
        q = proposer(max_cached_requests=2)
        for name, offset in (("A", 0), ("B", 1000), ("C", 2000)):
            await run_request(q, name, [t + offset for t in PROMPT], [t + offset for t in OUTPUT])
        assert q.num_cached_responses == 2
        offset = {"A": 0, "C": 2000}[first_prompt_of]
        return await draft(q, "D", [t + offset for t in PROMPT + OUTPUT[:1]])

    assert await after_three("A") == []
    assert await after_three("C") == [t + 2000 for t in OUTPUT[1:6]]


async def test_no_global_tree_when_max_cached_requests_is_zero():
    p = proposer(max_cached_requests=0)
    await run_request(p, "A", PROMPT, OUTPUT)
    assert p.num_cached_responses == 0
    assert await draft(p, "B", PROMPT + OUTPUT[:1]) == []
    assert await draft(p, "B", [1, 2, 1, 2, 1]) == [2, 1]  # the request's own tree still drafts


async def test_seq_id_reuse_keeps_the_earlier_response():
    """Cache keys are fresh per start: a reused sequence id (another verifier link, a retried request) does
    not evict the response it had before."""
    p = proposer()
    await run_request(p, "same", PROMPT, OUTPUT)
    assert await draft(p, "same", PROMPT + OUTPUT[:1]) == OUTPUT[1:6]


async def test_verifiers_connected_to_one_drafter_share_its_global_tree():
    """The drafter is its own service: a response generated through one verifier's link drafts a repeated
    request arriving through another (same sequence id too: ids are namespaced by link)."""
    suffix = proposer()
    server, port = await serve(suffix, "127.0.0.1", 0, num_speculative_tokens=8)
    one = await RemoteProposer.connect(RemoteProposerConfig(f"127.0.0.1:{port}", 1000))
    two = await RemoteProposer.connect(RemoteProposerConfig(f"127.0.0.1:{port}", 1000))
    try:
        full = PROMPT + OUTPUT
        for n in range(len(PROMPT) + 1, len(full) + 1):
            await one.propose([DraftInput("a", full[:n], 5)])
        one.release("a")
        await one.propose([DraftInput("b", [1, 2, 3], 1)])  # the next step carries the release
        assert suffix.num_active == 1 and suffix.num_cached_responses == 2
        [first] = await two.propose([DraftInput("a", PROMPT + OUTPUT[:1], 5)])
        assert list(first.token_ids) == OUTPUT[1:6]
    finally:
        await one.close()
        await two.close()
        await server.server.stop(0)


def test_build_proposer_from_the_speculative_config():
    config = SpeculativeConfig(
        method="suffix",
        suffix_decoding_max_tree_depth=16,
        suffix_decoding_max_cached_requests=7,
        suffix_decoding_max_spec_factor=2.0,
        suffix_decoding_min_token_prob=0.25,
    )
    built = build_proposer(config)
    assert isinstance(built, SuffixProposer) and built.method == "suffix"
    assert built.settings == SuffixSettings(16, 7, 2.0, 0.25, tree_depth=5)
    trees = build_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=3, num_draft_tokens=9))
    assert trees.settings.trees and trees.settings.tree_depth == 3
    with pytest.raises(ValueError):
        SuffixSettings(max_tree_depth=0)
    with pytest.raises(ValueError):
        SuffixSettings(min_token_prob=1.5)


def test_missing_package_is_a_clear_start_up_error(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "arctic_inference.suffix_decoding", None
    )  # import now raises ImportError
    with pytest.raises(MethodUnavailableError, match=r"arctic-inference.*make install"):
        SuffixProposer()


def test_importing_the_module_does_not_import_arctic_inference():
    code = "import sys, services.drafter.methods.suffix; assert 'arctic_inference' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- through the engine: lossless, and accepted -------------------------------------------------------------


def make_engine(model, proposers, max_num_seqs=4) -> Engine:
    """Every draft verified (adaptive speculation off), so the tests exercise every suffix draft whatever a tiny
    model's step costs are on the machine running them."""
    runner = LlamaFamilyRunner(model, max_num_seqs=max_num_seqs, max_model_len=160)
    config = EngineConfig(max_num_batched_tokens=24, log_stats_interval_s=0, adaptive_speculation=False)
    return Engine(runner, config, proposers, eos_token_ids=())


def greedy_requests(prompts, max_tokens, spec, prefix="r"):
    return [
        GenerationRequest(
            f"{prefix}{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec
        )
        for i, prompt in enumerate(prompts)
    ]


async def test_greedy_output_is_identical_with_suffix_speculation():
    model = tiny_llama(seed=3)
    rng = random.Random(5)
    prompts = [repetitive_prompt(rng, rng.randint(8, 40)) for _ in range(6)]
    plain = await run_schedule(make_engine(model, {}), {0: greedy_requests(prompts, 40, SpeculationParams())})

    suffix = proposer()
    engine = make_engine(model, {"suffix": suffix})
    spec = SpeculationParams(method="suffix", num_speculative_tokens=5)
    speculative = await run_schedule(
        engine, {0: greedy_requests(prompts[:3], 40, spec), 2: greedy_requests(prompts[3:], 40, spec, "s")}
    )
    for i in range(6):
        name = f"r{i}" if i < 3 else f"s{i - 3}"
        assert speculative[name].tokens == plain[f"r{i}"].tokens, name
    stats = engine.stats
    assert stats.num_fallbacks == 0  # the proposer never failed (a failure would silently mean K = 0)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert suffix.num_active == 0  # the engine released every finished sequence

    # the same prompts again: each one's earlier response is in the global tree, so nearly every draft is right
    again = await run_schedule(engine, {0: greedy_requests(prompts, 40, spec, "again")})
    drafted = accepted = 0
    for i in range(6):
        assert again[f"again{i}"].tokens == plain[f"r{i}"].tokens
        counts = again[f"again{i}"].outputs[-1].spec
        drafted, accepted = drafted + counts.num_draft_tokens, accepted + counts.num_accepted_tokens
    assert drafted >= 6 * 30 and accepted >= 0.9 * drafted, (accepted, drafted)


async def test_greedy_output_is_identical_with_suffix_trees():
    model = tiny_llama(seed=3)
    rng = random.Random(9)
    prompts = [repetitive_prompt(rng, rng.randint(8, 40)) for _ in range(6)]
    plain = await run_schedule(make_engine(model, {}), {0: greedy_requests(prompts, 40, SpeculationParams())})
    suffix = proposer(trees=True, min_token_prob=0.0)
    engine = make_engine(model, {"suffix": suffix})
    spec = SpeculationParams(method="suffix", num_speculative_tokens=8)
    for round_ in range(2):  # the second round drafts from the first's responses too
        speculative = await run_schedule(engine, {0: greedy_requests(prompts, 40, spec, f"t{round_}-")})
        for i in range(6):
            assert speculative[f"t{round_}-{i}"].tokens == plain[f"r{i}"].tokens, (round_, i)
    stats = engine.stats
    assert stats.num_fallbacks == 0 and stats.num_accepted_tokens > 0


async def test_sampled_output_follows_the_target_with_suffix_drafts():
    """The engine's rejection sampling keeps the target distribution with suffix drafts (deterministic, no q),
    in the style of test_engine_distribution: the joint of output tokens 2 and 3 of 3000 seeded requests."""
    target = tiny_llama(seed=21, vocab_size=V)
    params = SamplingParams(temperature=1.0)
    suffix = proposer()
    every_draft = SpeculationPlanner(StepCostModel(), adaptive=False)  # the count below must not hang on timing
    joint, engine = await sample_pairs(target, params, SpeculationParams("suffix", 2), {"suffix": suffix}, every_draft)
    stats = engine.stats
    assert stats.num_fallbacks == 0
    assert stats.num_drafts > 1000 and stats.num_accepted_tokens > 0
    expected = exact_joint(target, params)
    assert chi_square_p_value(joint, expected) > ALPHA, total_variation(joint, expected)


async def test_the_engine_host_cost_bench_measures_the_suffix_drafter_on_chat_text():
    """`engine_host_cost --method suffix`: serve's default drafter on the scripted chat text, its output the
    script's, some of its drafts accepted (phrases recur within and across requests), each request's text its own."""
    from services.bench.engine_host_cost import run_case

    drafted = await run_case(rows=2, speculate=True, tokens=48, vocab=512, adaptive=False, text="chat", rounds=2,
                             method="suffix")
    assert drafted["follows_script"] and drafted["tokens"] == 2 * 2 * 48
    assert drafted["drafts"] > 0 and 0 < drafted["accepted"] < drafted["draft_tokens"]
