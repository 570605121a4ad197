"""The engine drafting through a real Drafter server: greedy output is token-identical to speculation off, the
drafter dying mid-run costs only speed, and speculation resumes when a drafter comes back on the same port."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.drafter.server import serve
from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.remote_proposer import RemoteProposer, RemoteProposerConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams, SpeculationParams
from tests.engine_harness import Collected, run_schedule
from tests.prompts import repetitive_prompt
from tests.tiny_models import VOCAB, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def make_engine(model, proposers, adaptive_speculation: bool = True) -> Engine:
    runner = LlamaFamilyRunner(model, max_num_seqs=4, max_model_len=200)
    return Engine(
        runner,
        EngineConfig(max_num_batched_tokens=32, log_stats_interval_s=0, draft_timeout_s=2.0,
                     adaptive_speculation=adaptive_speculation),
        proposers,
    )


def remote_config(port: int, **overrides) -> RemoteProposerConfig:
    return RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB, step_timeout_s=1.5, **overrides)


def requests(prompts, max_tokens, specs) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens[i], temperature=0.0), spec)
        for i, (prompt, spec) in enumerate(zip(prompts, specs, strict=True))
    ]


async def test_remote_ngram_is_greedy_identical_and_accepted(model, ngram_drafter):
    _, port = ngram_drafter
    rng = random.Random(5)
    n = 6
    prompts = [repetitive_prompt(rng, rng.randint(3, 40)) for _ in range(n)]
    max_tokens = [rng.randint(8, 30) for _ in range(n)]
    plain = requests(prompts, max_tokens, [SpeculationParams()] * n)
    baseline = await run_schedule(make_engine(model, {}), {0: plain[:3], 2: plain[3:]})

    remote = await RemoteProposer.connect(remote_config(port))
    assert remote.method == "ngram"
    try:
        for k in range(1, 6):
            # every draft verified: with adaptive speculation whether a step asks at all follows measured timings
            engine = make_engine(model, {"ngram": remote}, adaptive_speculation=False)
            specs = [SpeculationParams("ngram", k if i % 2 else 1 + (k + i) % 5) for i in range(n)]
            spec_requests = requests(prompts, max_tokens, specs)
            result = await run_schedule(engine, {0: spec_requests[:3], 2: spec_requests[3:]})
            for i in range(n):
                assert result[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"K={k} r{i}"
            assert engine.stats.num_fallbacks == 0
            assert engine.stats.num_drafts > 0 and engine.stats.num_accepted_tokens > 0, f"K={k}"
            assert max(len(engine.stats.drafts_per_position), 1) <= 5
    finally:
        await remote.close()


async def test_drafter_outage_falls_back_and_recovers_on_the_same_port(model):
    server, port = await serve(NgramProposer(NgramSettings(1, 3)), "127.0.0.1", 0)
    rng = random.Random(9)
    prompts = [repetitive_prompt(rng, 30) for _ in range(3)]
    max_tokens = [120] * 3
    baseline = await run_schedule(
        make_engine(model, {}), {0: requests(prompts, max_tokens, [SpeculationParams()] * 3)}
    )

    remote = RemoteProposer(remote_config(port, backoff_initial_s=0.05, backoff_max_s=0.3))
    # every step asks (no adaptive speculation): the outage must meet asks, whatever the machine's timings (in a loaded
    # test run the planner, having seen one rejected draft, asked nobody in the 6 steps of the outage)
    engine = make_engine(model, {"ngram": remote}, adaptive_speculation=False)
    streams = {
        r.request_id: engine.add_request(r)
        for r in requests(prompts, max_tokens, [SpeculationParams("ngram", 2)] * 3)
    }
    collected = {request_id: Collected() for request_id in streams}

    async def steps(count: int, pause_s: float = 0.0) -> None:
        for _ in range(count):
            if engine.num_running == 0 and engine.num_waiting == 0:
                return
            await engine.step()
            for request_id, stream in streams.items():
                for output in stream.ready_outputs():
                    collected[request_id].tokens.extend(output.token_ids)
                    collected[request_id].outputs.append(output)
            await asyncio.sleep(pause_s)

    restarted = None
    try:
        await steps(6)
        drafts_before_outage = engine.stats.num_drafts
        assert drafts_before_outage > 0 and engine.stats.num_fallbacks == 0

        await server.server.stop(0)  # the drafter dies between two steps
        await steps(6, pause_s=0.02)
        assert engine.stats.num_fallbacks > 0
        assert engine.stats.num_drafts == drafts_before_outage
        assert engine.num_running > 0, "requests should still be running for the restart part"

        restarted, _ = await serve(NgramProposer(NgramSettings(1, 3)), "127.0.0.1", port)
        fallbacks_at_restart = engine.stats.num_fallbacks
        for _ in range(200):  # bounded: backoff (<= 0.3 s) plus the channel's reconnect (<= 2 s)
            if engine.stats.num_drafts > drafts_before_outage:
                break
            await steps(1, pause_s=0.02)
        assert engine.stats.num_drafts > drafts_before_outage, "speculation did not resume after the restart"
        assert engine.stats.num_fallbacks >= fallbacks_at_restart
        await steps(1000)
        assert engine.num_running == 0
        for request_id in streams:
            assert collected[request_id].tokens == baseline[request_id].tokens, request_id
            assert collected[request_id].finish_reason == "length"
    finally:
        await remote.close()
        await server.server.stop(0)
        if restarted is not None:
            await restarted.server.stop(0)


async def test_token_trees_cross_the_link_and_stay_greedy_identical(model):
    """A drafter sending trees over real gRPC: the parents reach the verifier, which finds the true branch (placed
    after random ones) and emits exactly what speculation off emits."""
    from tests.proposers import TreeProposer

    rng = random.Random(11)
    n = 4
    prompts = [repetitive_prompt(rng, rng.randint(5, 30)) for _ in range(n)]
    max_tokens = [20] * n
    baseline = await run_schedule(make_engine(model, {}), {0: requests(prompts, max_tokens, [SpeculationParams()] * n)})
    references = {f"r{i}": prompts[i] + tuple(baseline[f"r{i}"].tokens) for i in range(n)}
    server, port = await serve(TreeProposer(VOCAB, seed=4, references=_ByKey(references)), "127.0.0.1", 0,
                               num_speculative_tokens=6)
    remote = await RemoteProposer.connect(remote_config(port))
    try:
        # Adaptive speculation off: the planner sizes its asks and cuts by measured step times, and a tree asked
        # for 2 tokens holds 1 of the true branch, so the count below would depend on the machine's load (it
        # failed once in a fresh-clone run beside another worker: 43 accepted for 27 drafts).
        engine = make_engine(model, {"tree": remote}, adaptive_speculation=False)
        result = await run_schedule(engine, {0: requests(prompts, max_tokens, [SpeculationParams("tree", 6)] * n)})
        for i in range(n):
            assert result[f"r{i}"].tokens == baseline[f"r{i}"].tokens, f"r{i}"
        stats = engine.stats
        assert stats.num_fallbacks == 0 and stats.num_accepted_tokens >= 2 * stats.num_drafts > 0  # the branch
    finally:
        await remote.close()
        await server.server.stop(0)


class _ByKey(dict):
    """The drafter sees a sequence as (link, seq_id): the references looked up by the seq_id part."""

    def __getitem__(self, key):
        return super().__getitem__(key[1] if isinstance(key, tuple) else key)
