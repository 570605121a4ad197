"""The draft_model drafter as a real gRPC service on a free port: its Info declares the draft model's vocabulary
and tokenizer, a verifier whose target has another one refuses it, and engines drafting through it produce the
very tokens they produce without speculation, also two verifiers at once that share (and evict from) its slots."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.drafter.methods.draft_model import DraftModelProposer
from services.drafter.server import serve
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import IncompatibleDrafterError, RemoteProposer, RemoteProposerConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import run_schedule
from tests.prompts import repetitive_prompt
from tests.tiny_models import VOCAB, tiny_llama

FINGERPRINT = "d" * 64  # stands for the draft model's tokenizer (the target's, when they match)
MAX_K = 6


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3)


@pytest.fixture
async def drafter_port():
    """A draft_model drafter whose draft model is the target's twin (same weights): its drafts are accepted.
    Four KV slots, fewer than two verifiers' sequences."""
    runner = LlamaFamilyRunner(tiny_llama(seed=3), max_num_seqs=4, max_model_len=200, pack_weights=False)
    proposer = DraftModelProposer(runner, FINGERPRINT)
    server, port = await serve(proposer, "127.0.0.1", 0, num_speculative_tokens=MAX_K)
    try:
        yield port
    finally:
        await server.server.stop(0)
        proposer.close()


def remote_config(port: int, vocab_size: int = VOCAB, fingerprint: str = FINGERPRINT) -> RemoteProposerConfig:
    return RemoteProposerConfig(f"127.0.0.1:{port}", vocab_size, fingerprint, step_timeout_s=1.5)


async def test_info_declares_the_draft_vocabulary_and_a_mismatched_verifier_refuses_it(drafter_port):
    remote = await RemoteProposer.connect(remote_config(drafter_port))
    try:
        info = await remote.info()
        declared = info.capabilities
        assert (info.method, declared.vocab_size, declared.tokenizer_fingerprint, declared.max_speculative_tokens) == (
            "draft_model", VOCAB, FINGERPRINT, MAX_K,
        )
        assert declared.pre_drafts and not declared.needs_hidden_states and not declared.sends_trees
    finally:
        await remote.close()
    with pytest.raises(IncompatibleDrafterError, match=rf"\(draft_model\).*vocabulary of {VOCAB} tokens.*has {VOCAB + 1}"):
        await RemoteProposer.connect(remote_config(drafter_port, vocab_size=VOCAB + 1, fingerprint=""))
    # the same tokenizer with an embedding table padded to another size (Qwen2.5-0.5B drafting for the 7B)
    await (await RemoteProposer.connect(remote_config(drafter_port, vocab_size=VOCAB + 64))).close()
    with pytest.raises(IncompatibleDrafterError, match=r"\(draft_model\) uses a different tokenizer"):
        await RemoteProposer.connect(remote_config(drafter_port, fingerprint="e" * 64))


def make_engine(model, proposers) -> Engine:
    runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=200)
    config = EngineConfig(
        max_num_batched_tokens=32, log_stats_interval_s=0, draft_timeout_s=2.0, adaptive_speculation=False
    )
    return Engine(runner, config, proposers)


def schedule(prompts, max_tokens, spec: SpeculationParams) -> dict[int, list[GenerationRequest]]:
    requests = [
        GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens[i], temperature=0.0), spec)
        for i, prompt in enumerate(prompts)
    ]
    return {0: requests[:2], 2: requests[2:]}


async def test_engines_drafting_through_the_service_are_greedy_identical(target, drafter_port):
    rng = random.Random(23)
    prompts = [repetitive_prompt(rng, rng.randint(4, 40)) for _ in range(4)]
    max_tokens = [rng.randint(15, 40) for _ in range(4)]
    baseline = await run_schedule(make_engine(target, {}), schedule(prompts, max_tokens, SpeculationParams()))

    remotes = [await RemoteProposer.connect(remote_config(drafter_port)) for _ in range(2)]
    try:
        alone = make_engine(target, {"draft_model": remotes[0]})
        result = await run_schedule(alone, schedule(prompts, max_tokens, SpeculationParams("draft_model", 5)))
        assert {r: c.tokens for r, c in result.items()} == {r: c.tokens for r, c in baseline.items()}
        assert alone.stats.num_fallbacks == 0
        assert alone.stats.num_accepted_tokens > 0.9 * alone.stats.num_draft_tokens > 0

        # two verifiers, 8 sequences, 4 slots: the drafter evicts and re-prefills, the output does not change
        engines = [make_engine(target, {"draft_model": remote}) for remote in remotes]
        results = await asyncio.gather(*(
            run_schedule(engine, schedule(prompts, max_tokens, SpeculationParams("draft_model", k)))
            for engine, k in zip(engines, (3, 6), strict=True)
        ))
        for both in results:
            assert {r: c.tokens for r, c in both.items()} == {r: c.tokens for r, c in baseline.items()}
        assert all(engine.stats.num_draft_tokens > 0 for engine in engines)
    finally:
        for remote in remotes:
            await remote.close()
