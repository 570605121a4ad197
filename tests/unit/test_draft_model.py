"""The `draft_model` drafter method with tiny random models that share a vocabulary (no mocks of the runner).

What must hold: greedy output with its drafts equals the output without speculation (and the target drafting
for itself is accepted in full, an unrelated model mostly not); its per-sequence KV cache never makes a draft
differ from the one a fresh drafter, which prefills the committed tokens from scratch, proposes, whatever was
accepted, rolled back or evicted in between; sequences it cannot draft get an empty draft, never an error.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest
from transformers import AutoTokenizer

from services.common.drafter_methods import build_proposer
from services.common.proposer import DraftInput, capabilities_of
from services.common.speculative_config import SpeculativeConfig
from services.drafter.methods.draft_model import DraftModelProposer, DraftModelSettings
from services.drafter.model_drafting import (
    FREE_PADDING_TOKENS,
    MIN_CATCH_UP_TOKENS,
    CatchUpBudget,
    DraftRequest,
    ModelDrafter,
    catch_up_batches,
    chunk_feeds,
)
from services.drafter.sequence_slots import SequenceSlots, common_prefix_length
from services.drafter.server import add_drafter_flags, settings_from_args
from services.inprocess import IncompatibleProposerError, local_proposers
from services.modeling.kernel_choice import KernelChooser
from services.modeling.llama_runner import LlamaFamilyRunner
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.cpu_features import needs_bf16_linear
from tests.engine_harness import run_schedule
from tests.prompts import random_workload, repetitive_prompt
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2, word_tokenizer

MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def draft_model():
    """Same architecture and vocabulary as the target, other weights: a poor but valid draft model."""
    return tiny_qwen2(seed=21)


def proposer_for(model, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, fingerprint="") -> DraftModelProposer:
    return DraftModelProposer(LlamaFamilyRunner(model, max_num_seqs, max_model_len, pack_weights=False), fingerprint)


def bf16_wins(name, kernel, x) -> float:
    """A fake kernel timer under which the packed bfloat16 copy is always the fastest (every call still runs)."""
    kernel(x)
    return 0.1 if name == "bf16" else 1.0


def bf16_proposer(model, max_num_seqs=4) -> DraftModelProposer:
    """A drafter whose runner owns `model` and runs every linear on its packed bfloat16 copy, as a CPU drafter
    does where that copy measures faster (draft_model.build_proposer: allow_bf16)."""
    chooser = KernelChooser(measure=bf16_wins, one_layout=True, allow_bf16=True)
    runner = LlamaFamilyRunner(model, max_num_seqs, MAX_MODEL_LEN, kernel_chooser=chooser, owns_model=True)
    assert runner.freed_weight_bytes > 0 and "bf16 at all M" in runner.kernels
    assert all(layer.self_attn.q_proj.weight.numel() == 0 for layer in model.model.layers)  # one copy: the bf16
    return DraftModelProposer(runner)


async def fresh_draft(model, token_ids, k, max_model_len=MAX_MODEL_LEN) -> tuple[int, ...]:
    """What a drafter that never saw the sequence proposes: it prefills the committed tokens from scratch."""
    proposer = proposer_for(model, max_num_seqs=1, max_model_len=max_model_len)
    try:
        return tuple((await proposer.propose([DraftInput("fresh", list(token_ids), k)]))[0].token_ids)
    finally:
        proposer.close()


def commit(rng: random.Random, committed: list[int], draft) -> list[int]:
    """What a verifier commits after checking `draft`: an accepted prefix of it, then one token of its own that
    differs from the next draft token (or follows a fully accepted draft)."""
    accepted = rng.randint(0, len(draft))
    bonus = rng.randrange(VOCAB)
    if accepted < len(draft) and bonus == draft[accepted]:
        bonus = (bonus + 1) % VOCAB
    return committed + list(draft[:accepted]) + [bonus]


# -- bookkeeping -------------------------------------------------------------------------------------------
def test_slots_keep_their_holders_evict_the_least_recently_used_and_refuse_past_the_call():
    slots = SequenceSlots(2)
    assert slots.assign(["a", "b"]).admitted == ("a", "b")
    assert slots.assign(["a"]).admitted == ()  # a is now the most recently used
    outcome = slots.assign(["c"])
    assert (outcome.evicted, outcome.admitted) == (("b",), ("c",))
    outcome = slots.assign(["a", "c", "d"])  # every slot belongs to this call: d waits
    assert (outcome.evicted, outcome.admitted, outcome.refused) == ((), (), ("d",))
    outcome = slots.assign(["d", "b"])
    assert outcome.evicted == ("a", "c") and outcome.admitted == ("d", "b")
    assert slots.drop("d") and not slots.drop("d") and len(slots) == 1
    with pytest.raises(ValueError, match="at most once"):
        slots.assign(["b", "b"])


def test_common_prefix_length():
    a = np.array([1, 2, 3, 4])
    assert common_prefix_length(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix_length(a, np.array([1, 2, 9])) == 2
    assert common_prefix_length(a, np.array([7])) == 0
    assert common_prefix_length(np.array([], dtype=np.int64), a) == 0


def test_catch_up_is_one_forward_in_the_steady_state_and_a_prefill_does_not_pad_everyone():
    assert catch_up_batches([1, 2, 1, 1, 2, 1, 1, 1]) == [[1, 4, 0, 2, 3, 5, 6, 7]]
    lengths = [1, 300, 2, 1, 280]
    batches = catch_up_batches(lengths)
    assert batches[0][:2] == [1, 4]  # two prefills of similar length share a forward
    assert len(batches) > 1 and sorted(b for batch in batches for b in batch) == [0, 1, 2, 3, 4]
    for batch in batches:  # padding never more than doubles a wide forward
        padded, real = len(batch) * max(lengths[b] for b in batch), sum(lengths[b] for b in batch)
        assert padded <= max(FREE_PADDING_TOKENS, 2 * real)
    assert catch_up_batches([]) == []


# -- drafts ------------------------------------------------------------------------------------------------
async def test_drafts_equal_a_fresh_drafter_after_partial_acceptance_and_rollback(draft_model):
    """The KV cache is set to the committed length each call: the longest common prefix is kept, the rest
    (rejected drafts, a rolled-back tail) dropped, and the next draft is what a fresh drafter proposes."""
    rng = random.Random(5)
    proposer = proposer_for(draft_model)
    committed = list(repetitive_prompt(rng, 20))
    try:
        for step in range(14):
            k = rng.randint(1, 6)
            draft = (await proposer.propose([DraftInput("a", committed, k)]))[0]
            assert draft.probs is None  # argmax drafting: deterministic, no q
            assert tuple(draft.token_ids) == await fresh_draft(draft_model, committed, k), f"step {step}"
            assert len(draft.token_ids) == k
            if step == 9:
                committed = committed[:-4]  # a rollback (the verifier re-opened the sequence shorter)
            else:
                committed = commit(rng, committed, draft.token_ids)
    finally:
        proposer.close()


async def test_several_sequences_in_one_call_draft_as_each_would_alone(draft_model):
    rng = random.Random(8)
    proposer = proposer_for(draft_model, max_num_seqs=4)
    sequences = {f"s{i}": list(repetitive_prompt(rng, rng.randint(3, 50))) for i in range(4)}
    try:
        for _ in range(5):
            inputs = [DraftInput(seq_id, tokens, rng.randint(1, 5)) for seq_id, tokens in sequences.items()]
            drafts = await proposer.propose(inputs)
            for item, draft in zip(inputs, drafts, strict=True):
                assert tuple(draft.token_ids) == await fresh_draft(draft_model, item.token_ids, item.num_speculative_tokens)
                sequences[item.seq_id] = commit(rng, list(item.token_ids), draft.token_ids)
    finally:
        proposer.close()


async def test_eviction_resyncs_from_the_token_ids_and_never_raises(draft_model):
    """Two slots, five live sequences: each call evicts the least recently used, and an evicted sequence that
    comes back is prefilled again from its committed tokens; a call with more sequences than slots drafts as
    many as fit (those already cached first) and gives the others an empty draft."""
    rng = random.Random(13)
    proposer = proposer_for(draft_model, max_num_seqs=2)
    sequences = {f"s{i}": list(repetitive_prompt(rng, rng.randint(5, 30))) for i in range(5)}
    try:
        for _ in range(12):
            chosen = rng.sample(sorted(sequences), 2)
            inputs = [DraftInput(seq_id, sequences[seq_id], 4) for seq_id in chosen]
            for item, draft in zip(inputs, await proposer.propose(inputs), strict=True):
                assert tuple(draft.token_ids) == await fresh_draft(draft_model, item.token_ids, 4)
                sequences[item.seq_id] = commit(rng, item.token_ids, draft.token_ids)
        assert proposer.runner.num_free_slots() == 0
        last = chosen  # hold the two slots
        everyone = [DraftInput(seq_id, sequences[seq_id], 3) for seq_id in sorted(sequences)]
        drafts = dict(zip(sorted(sequences), await proposer.propose(everyone), strict=True))
        assert {seq_id for seq_id, draft in drafts.items() if draft.token_ids} == set(last)
        for seq_id in last:
            assert tuple(drafts[seq_id].token_ids) == await fresh_draft(draft_model, sequences[seq_id], 3)
    finally:
        proposer.close()


def test_chunk_feeds_keeps_decoding_rows_whole_and_shares_the_rest_among_prefills():
    feeds = [[1], list(range(100)), [2, 3], list(range(50))]
    assert chunk_feeds(feeds, None) == feeds
    out = chunk_feeds(feeds, 64)
    assert out[0] == [1] and out[2] == [2, 3]  # decoding rows are never cut
    assert out[1] == list(range(61)) and out[3] == []  # the rest goes to the prefills in order
    # short rows that use up the budget still leave the first prefill a chunk, so it always progresses
    out = chunk_feeds([[7] * 20, [8] * 20, list(range(100))], 10)
    assert out[:2] == [[7] * 20, [8] * 20] and out[2] == list(range(MIN_CATCH_UP_TOKENS))


def test_the_budget_is_unbounded_until_a_long_feed_is_timed_and_leans_to_the_slower_rate():
    budget = CatchUpBudget(seconds=0.5)
    assert budget.limit() is None
    budget.observe(4, 1.0)  # a decode-sized forward says little about prefill speed
    assert budget.limit() is None
    budget.observe(200, 1.0)
    assert budget.limit() == 100
    budget.observe(400, 1.0)  # faster: halfway there
    assert budget.limit() == 150
    budget.observe(40, 1.0)  # slower: at once
    assert budget.limit() == MIN_CATCH_UP_TOKENS


def test_a_long_prompt_is_fed_in_chunks_and_then_drafts_as_a_fresh_drafter(draft_model):
    """With a budget of 40 tokens a call, a 130-token prompt takes four calls (three without a draft) while a
    decoding sequence beside it drafts every call; then its draft is what a drafter fed the prompt at once drafts."""
    ticks = iter(range(10**6))
    budget = CatchUpBudget(seconds=1.0, tokens_per_s=40.0, clock=lambda: float(next(ticks)))  # every forward: 1 s
    drafter = ModelDrafter(LlamaFamilyRunner(draft_model, 2, MAX_MODEL_LEN, pack_weights=False), budget)
    unchunked = ModelDrafter(LlamaFamilyRunner(draft_model, 1, MAX_MODEL_LEN, pack_weights=False))
    rng = random.Random(5)
    prompt = np.array(repetitive_prompt(rng, 130), dtype=np.int64)
    other = np.array(repetitive_prompt(rng, 10), dtype=np.int64)
    drafter.draft([DraftRequest("other", other, 3)])
    lengths = []
    for _ in range(4):
        drafts = drafter.draft([DraftRequest("long", prompt, 3), DraftRequest("other", other, 3)])
        lengths.append(len(drafts[0]))
        assert len(drafts[1]) == 3
        other = np.concatenate([other, np.array(drafts[1][:1], dtype=np.int64)])
    assert lengths == [0, 0, 0, 3]
    assert budget.limit() == 40  # each chunk of 40 tokens took "1 s"
    assert drafts[0] == tuple(unchunked.draft([DraftRequest("fresh", prompt, 3)])[0])


async def test_sequences_that_do_not_fit_get_no_draft(draft_model):
    proposer = proposer_for(draft_model, max_num_seqs=2, max_model_len=32)
    rng = random.Random(2)
    tokens = list(repetitive_prompt(rng, 40))
    try:
        drafts = await proposer.propose([
            DraftInput("long", tokens[:33], 5),  # longer than a slot
            DraftInput("edge", tokens[:32], 5),  # fills a slot: one draft, from the last position's logits
            DraftInput("near", tokens[:30], 5),  # room for 3 drafts (2 of them fed)
        ])
        assert [len(d.token_ids) for d in drafts] == [0, 1, 3]
        assert tuple(drafts[2].token_ids) == await fresh_draft(draft_model, tokens[:30], 3, max_model_len=32)
        # a cached sequence that outgrows its slot gives the slot back; ids outside the vocabulary draft nothing
        drafts = await proposer.propose([DraftInput("near", tokens[:33], 2), DraftInput("odd", [1, VOCAB + 7], 2)])
        assert [len(d.token_ids) for d in drafts] == [0, 0]
        assert proposer.runner.num_free_slots() == 1  # "edge" only
        assert [len(d.token_ids) for d in await proposer.propose([DraftInput("empty", [], 3),
                                                                   DraftInput("zero", tokens[:5], 0)])] == [0, 0]
    finally:
        proposer.close()


async def test_release_frees_the_slot_at_the_next_call(draft_model):
    proposer = proposer_for(draft_model, max_num_seqs=2)
    try:
        await proposer.propose([DraftInput("a", [1, 2, 3], 2), DraftInput("b", [4, 5, 6], 2)])
        assert proposer.runner.num_free_slots() == 0
        proposer.release("a")
        proposer.release("never-seen")
        await proposer.propose([DraftInput("b", [4, 5, 6, 7], 2)])
        assert proposer.runner.num_free_slots() == 1
    finally:
        proposer.close()


# -- in the engine ----------------------------------------------------------------------------------------
def make_engine(model, proposers) -> Engine:
    runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    config = EngineConfig(
        max_num_batched_tokens=24, log_stats_interval_s=0, adaptive_speculation=False, draft_timeout_s=5.0
    )
    return Engine(runner, config, proposers, eos_token_ids=())


async def run_requests(engine: Engine, prompts, max_tokens, spec: SpeculationParams):
    requests = [
        GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens[i], temperature=0.0), spec)
        for i, prompt in enumerate(prompts)
    ]
    return await run_schedule(engine, {0: requests[:3], 3: requests[3:]})


@pytest.mark.parametrize("drafter", ["target itself", "other model",
                                     pytest.param("target itself on bf16 kernels", marks=needs_bf16_linear)])
async def test_greedy_output_is_identical_and_acceptance_follows_the_draft_model(target, draft_model, drafter):
    prompts, max_tokens = random_workload(17, 6, (4, 40), (10, 40))
    baseline = await run_requests(make_engine(target, {}), prompts, max_tokens, SpeculationParams())
    if drafter == "target itself on bf16 kernels":  # rounded products: other drafts in near-ties, never other output
        proposer = bf16_proposer(tiny_llama(seed=3), max_num_seqs=3)
    else:
        proposer = proposer_for(tiny_llama(seed=3) if drafter == "target itself" else draft_model, max_num_seqs=3)
    try:
        for k in (1, 3, 6):
            engine = make_engine(target, {"draft_model": proposer})
            result = await run_requests(engine, prompts, max_tokens, SpeculationParams("draft_model", k))
            for i in range(len(prompts)):
                assert result[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"K={k} r{i}"
            stats = engine.stats
            assert stats.num_fallbacks == 0 and stats.num_draft_tokens > 0
            acceptance = stats.num_accepted_tokens / stats.num_draft_tokens
            if drafter.startswith("target itself"):
                assert acceptance > 0.95, f"K={k}: {acceptance:.2f}"
            else:
                assert acceptance < 0.5, f"K={k}: {acceptance:.2f}"
    finally:
        proposer.close()


# -- configuration ----------------------------------------------------------------------------------------
def test_drafter_flags_configure_the_draft_model():
    parser = argparse.ArgumentParser()
    add_drafter_flags(parser)
    settings = settings_from_args(parser.parse_args([
        "--method", "draft_model", "--model", "qwen2.5-coder-0.5b-instruct", "--device", "cpu",
        "--dtype", "float32", "--max-num-seqs", "3", "--max-model-len", "1024", "--enforce-eager",
    ]))
    draft = DraftModelSettings.from_config(settings.speculation)
    assert draft == DraftModelSettings("qwen2.5-coder-0.5b-instruct", "cpu", "float32", 3, 1024)
    assert settings.speculation.enforce_eager
    defaults = DraftModelSettings.from_config(SpeculativeConfig.parse('{"method": "draft_model", "model": "m"}'))
    assert (defaults.device, defaults.dtype, defaults.max_num_seqs, defaults.max_model_len) == ("auto", "auto", 16, None)
    with pytest.raises(ValueError, match="needs a 'model'"):
        settings_from_args(parser.parse_args(["--method", "draft_model"]))


def test_the_registry_builds_it_from_a_model_folder_and_it_declares_its_vocabulary(tmp_path, draft_model):
    folder = tmp_path / "tiny-draft"
    draft_model.save_pretrained(folder)
    tokenizer = word_tokenizer(VOCAB)
    tokenizer.save_pretrained(folder)
    config = SpeculativeConfig(
        method="draft_model", model=str(folder), draft_device="cpu", draft_dtype="float32",
        draft_max_num_seqs=3, max_model_len=64, num_speculative_tokens=4,
    )
    proposer = build_proposer(config)
    try:
        assert isinstance(proposer, DraftModelProposer)
        # the fingerprint of the tokenizer as loaded from the folder (here a Qwen2Tokenizer, which adds a token
        # of its own), i.e. what a verifier serving the same folder publishes
        loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
        assert capabilities_of(proposer).vocabulary == (VOCAB, tokenizer_fingerprint(loaded_tokenizer))
        assert (proposer.runner.max_num_seqs, proposer.runner.max_model_len) == (3, 64)
    finally:
        proposer.close()
    # built in-process (specserve generate), it is held to the target's vocabulary as a drafter service is
    fingerprint = tokenizer_fingerprint(loaded_tokenizer)
    local_proposers(config, (VOCAB, fingerprint))["draft_model"].close()
    with pytest.raises(IncompatibleProposerError, match=rf"vocabulary of {VOCAB} tokens.*has {VOCAB + 1}"):
        local_proposers(config, (VOCAB + 1, ""))
    local_proposers(config, (VOCAB + 64, fingerprint))["draft_model"].close()  # same tokenizer, padded table
    with pytest.raises(IncompatibleProposerError, match="different tokenizer"):
        local_proposers(config, (VOCAB, "another tokenizer"))


async def test_a_prompt_that_starts_like_an_earlier_one_is_fed_from_the_prefix_cache(draft_model):
    """A second sequence sharing a 40-token prefix with a first one takes its cached blocks (only the rest is
    fed) and drafts exactly what a fresh drafter does."""
    rng = random.Random(12)
    shared = list(repetitive_prompt(rng, 40))
    proposer = proposer_for(draft_model)
    try:
        await proposer.propose([DraftInput("first", shared + [5, 6, 7], 3)])
        second = shared + [9, 8]
        draft = (await proposer.propose([DraftInput("second", second, 4)]))[0]
        assert tuple(draft.token_ids) == await fresh_draft(draft_model, second, 4)
        usage = proposer.runner.kv_usage
        assert usage.prefix_cache.hits == (len(second) - 1) // usage.block_size * usage.block_size > 0
    finally:
        proposer.close()
