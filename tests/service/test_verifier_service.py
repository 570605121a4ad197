"""The Verifier service on a real port: Generate streams exactly what the engine itself produces (greedy), with or
without a real drafter service attached; errors follow the proto's status-code contract; a cancelled call frees
its slot; Info and the Prometheus endpoint report what happened."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import urllib.request

import grpc
import pytest

from services.modeling.llama_runner import LlamaFamilyRunner
from services.verifier.engine import Engine
from services.verifier.engine_config import EngineConfig
from services.verifier.sampling_params import GenerationRequest, SamplingParams
from services.verifier.main import add_verifier_flags, settings_from_args
from services.verifier.server import start_verifier
from services.verifier.settings import VerifierSettings
from services.verifier.wire import verifier_pb2, verifier_pb2_grpc
from tests.ports import free_port
from tests.prompts import repetitive_prompt
from tests.tiny_models import VOCAB, tiny_llama

MODEL_ID = "tiny-llama"
MAX_MODEL_LEN = 200
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def settings(**overrides) -> VerifierSettings:
    base = {"port": 0, "metrics_port": 0, "max_num_seqs": 4, "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 32,
                "draft_timeout_s": 2.0, "log_stats_interval_s": 0}
    return VerifierSettings(**{**base, **overrides})


@contextlib.asynccontextmanager
async def verifier(model, **overrides):
    """(running verifier, stub) on free ports; stopped afterwards."""
    running = await start_verifier(model, MODEL_ID, settings(**overrides))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield running, verifier_pb2_grpc.VerifierStub(channel)
    finally:
        await running.stop(0, 0.5)


def greedy(request_id: str, prompt, max_tokens: int, method: str = "", **speculation):
    return verifier_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=verifier_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        speculation=verifier_pb2.SpeculationParams(method=method, **speculation),
    )


async def collect(stub, request) -> list:
    return [message async for message in stub.Generate(request, timeout=10)]


async def engine_output(model, prompt, max_tokens: int) -> list[int]:
    runner = LlamaFamilyRunner(model, max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
    async with Engine(runner, EngineConfig(log_stats_interval_s=0)) as engine:
        request = GenerationRequest("ref", tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return [t async for output in engine.generate(request) for t in output.token_ids]


async def test_generate_streams_the_engines_greedy_output_with_and_without_a_drafter(model, ngram_drafter):
    _, drafter_port = ngram_drafter
    rng = random.Random(7)
    prompts = [repetitive_prompt(rng, n) for n in (12, 30, 45)]
    expected = [await engine_output(model, p, 24) for p in prompts]

    async with verifier(model) as (_, stub):
        plain = await asyncio.gather(*(collect(stub, greedy(f"p{i}", p, 24)) for i, p in enumerate(prompts)))
    # every draft verified (no adaptive speculation): under load the planner may find drafting over gRPC not worth a
    # tiny model's step and ask nothing, which this test of the service's wiring must not depend on
    drafting = {"drafters": [f"ngram=127.0.0.1:{drafter_port}"], "speculative_config": NGRAM,
                "adaptive_speculation": False}
    async with verifier(model, **drafting) as (_, stub):
        drafted = await asyncio.gather(*(collect(stub, greedy(f"d{i}", p, 24)) for i, p in enumerate(prompts)))

    for want, off, on in zip(expected, plain, drafted, strict=True):
        assert [t for m in off for t in m.token_ids] == want
        assert [t for m in on for t in m.token_ids] == want
        assert off[-1].finish_reason == on[-1].finish_reason == verifier_pb2.FINISH_REASON_LENGTH
        assert all(m.finish_reason == verifier_pb2.FINISH_REASON_UNSPECIFIED for m in on[:-1])
        assert on[-1].usage.completion_tokens == 24 and on[-1].usage.prompt_tokens > 0
        assert off[-1].speculation.method == "" and off[-1].speculation.num_drafts == 0
    stats = [messages[-1].speculation for messages in drafted]
    assert all(s.method == "ngram" for s in stats)
    assert sum(s.num_drafts for s in stats) > 0 and sum(s.num_accepted_tokens for s in stats) > 0
    assert any(len(m.token_ids) > 1 for messages in drafted for m in messages)  # accepted drafts: several per step


async def test_logprobs_and_none_method(model, ngram_drafter):
    _, drafter_port = ngram_drafter
    async with verifier(model, drafters=[f"ngram=127.0.0.1:{drafter_port}"]) as (_, stub):
        request = greedy("lp", [1, 2, 3, 1, 2, 3], 5, method="none")
        request.sampling.logprobs = 2
        messages = await collect(stub, request)
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    first = messages[0].logprobs[0]
    assert first.token_id == messages[0].token_ids[0] and len(first.top) == 2 and first.logprob <= 0
    assert messages[-1].speculation.num_drafts == 0 and messages[-1].speculation.method == ""


async def test_draft_pipelining_is_refused_for_a_drafter_that_does_not_pre_draft(model, ngram_drafter):
    _, drafter_port = ngram_drafter
    async with verifier(model, drafters=[f"ngram=127.0.0.1:{drafter_port}"], speculative_config=NGRAM) as (_, stub):
        for method in ("ngram", "none"):
            request = greedy(f"p-{method}", [1, 2, 3, 1, 2, 3], 5, method=method)
            request.speculation.draft_pipelining = True
            details = await expect_status(collect(stub, request), grpc.StatusCode.INVALID_ARGUMENT)
            assert "draft_pipelining" in details
        request = greedy("p-off", [1, 2, 3, 1, 2, 3], 5, method="ngram")
        request.speculation.draft_pipelining = False  # off is what this drafter does anyway
        assert sum(len(m.token_ids) for m in await collect(stub, request)) == 5


async def expect_status(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == code, raised.value.details()
    return raised.value.details()


async def test_invalid_requests_are_invalid_argument_and_reused_ids_already_exist(model):
    async with verifier(model) as (_, stub):
        too_long = greedy("long", [1] * MAX_MODEL_LEN, 4)
        assert "prompt" in await expect_status(collect(stub, too_long), grpc.StatusCode.INVALID_ARGUMENT)
        hot = greedy("hot", [1, 2, 3], 4)
        hot.sampling.temperature = -1.0
        assert "temperature" in await expect_status(collect(stub, hot), grpc.StatusCode.INVALID_ARGUMENT)
        unknown = greedy("eagle", [1, 2, 3], 4, method="eagle")
        assert "eagle" in await expect_status(collect(stub, unknown), grpc.StatusCode.INVALID_ARGUMENT)
        too_many_k = greedy("k", [1, 2, 3], 4, method="ngram", num_speculative_tokens=1000)
        await expect_status(collect(stub, too_many_k), grpc.StatusCode.INVALID_ARGUMENT)

        first = stub.Generate(greedy("same", [1, 2, 3], 150), timeout=10)
        await first.read()
        await expect_status(collect(stub, greedy("same", [4, 5], 4)), grpc.StatusCode.ALREADY_EXISTS)
        first.cancel()


async def test_full_range_seeds_run_beside_other_requests_and_non_finite_values_are_refused(model):
    """The verifier is a public API too: a uint64 seed >= 2**63 once failed every request of its engine step."""
    def seeded(request_id: str, seed: int | None):
        request = greedy(request_id, [5, 6, 7, 5, 6], 8)
        request.sampling.temperature = 1.0
        if seed is not None:
            request.sampling.seed = seed
        return request

    async with verifier(model) as (_, stub):
        replies = await asyncio.gather(
            collect(stub, seeded("max", 2**64 - 1)), collect(stub, seeded("half", 2**63)),
            collect(stub, seeded("plain", None)), collect(stub, greedy("greedy", [1, 2, 3], 8)),
        )
        assert all(sum(len(m.token_ids) for m in reply) == 8 for reply in replies)
        again = await collect(stub, seeded("max-again", 2**64 - 1))
        assert [t for m in again for t in m.token_ids] == [t for m in replies[0] for t in m.token_ids]
        for field, value in (("temperature", float("nan")), ("temperature", float("inf")),
                             ("repetition_penalty", float("inf"))):
            bad = greedy(f"bad-{field}-{value}", [1, 2, 3], 4)
            setattr(bad.sampling, field, value)
            assert field in await expect_status(collect(stub, bad), grpc.StatusCode.INVALID_ARGUMENT)


async def info(stub):
    return await stub.Info(verifier_pb2.InfoRequest(), timeout=2)


async def wait_until_idle(stub, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while (reply := await info(stub)).num_running or reply.num_waiting:
            await asyncio.sleep(0.02)


async def test_full_queue_is_resource_exhausted(model):
    async with verifier(model, max_num_seqs=1, max_waiting_requests=0) as (_, stub):
        running = stub.Generate(greedy("a", [1, 2, 3], 150), timeout=10)
        await running.read()  # admitted: the only slot is taken
        details = await expect_status(collect(stub, greedy("b", [1, 2, 3], 4)), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "waiting queue is full" in details
        running.cancel()
        await wait_until_idle(stub)
        assert len(await collect(stub, greedy("c", [1, 2, 3], 4))) > 0  # served again once the slot is free


async def test_cancelling_a_call_frees_its_slot(model):
    async with verifier(model) as (running, stub):
        aborted = []  # (request id, whether it was still running): proves the cancel, not completion, freed it
        engine_abort = running.engine.abort
        running.engine.abort = lambda request_id: aborted.append((request_id, engine_abort(request_id))) or True
        call = stub.Generate(greedy("c", [1, 2, 3], MAX_MODEL_LEN - 4), timeout=10)
        await call.read()
        assert (await info(stub)).num_running == 1
        call.cancel()
        await wait_until_idle(stub)
        assert aborted == [("c", True)]


async def test_an_engine_failure_is_internal_and_frees_the_slot(model):
    async with verifier(model) as (running, stub):
        def broken_forward(rows):
            raise RuntimeError("device fell over")

        running.engine.runner.forward = broken_forward
        details = await expect_status(collect(stub, greedy("x", [1, 2, 3], 4)), grpc.StatusCode.INTERNAL)
        assert "device fell over" in details
        await wait_until_idle(stub)


async def test_info_reports_model_facts_and_drafter_states(model, ngram_drafter):
    _, drafter_port = ngram_drafter
    dead = f"127.0.0.1:{free_port()}"
    drafters = [f"ngram=127.0.0.1:{drafter_port}", f"gone={dead}"]
    async with verifier(model, drafters=drafters, speculative_config=NGRAM, max_num_seqs=3) as (_running, stub):
        reply = await info(stub)
        assert reply.model_id == MODEL_ID and reply.vocab_size == VOCAB and reply.max_model_len == MAX_MODEL_LEN
        assert reply.max_num_seqs == 3 and reply.num_running == 0 and reply.num_waiting == 0
        assert reply.default_speculative_method == "ngram" and reply.default_num_speculative_tokens == 4
        states = {d.name: d for d in reply.drafters}
        assert states["ngram"].state == verifier_pb2.DRAFTER_STATE_SERVING and states["ngram"].method == "ngram"
        assert states["ngram"].address == f"127.0.0.1:{drafter_port}" and states["ngram"].detail == ""
        assert states["gone"].state == verifier_pb2.DRAFTER_STATE_DISCONNECTED and states["gone"].detail
        assert states["gone"].method == "" and states["gone"].address == dead

        messages = await collect(stub, greedy("g", [1, 2, 3, 1, 2, 3], 6, method="gone"))
        assert sum(len(m.token_ids) for m in messages) == 6  # a dead drafter costs speed, not the request
        gone = {d.name: d for d in (await info(stub)).drafters}["gone"]
        assert gone.state == verifier_pb2.DRAFTER_STATE_DISCONNECTED and gone.num_fallbacks > 0


async def state_becomes(stub, wanted) -> None:
    async with asyncio.timeout(10):
        while (await info(stub)).drafters[0].state != wanted:
            await asyncio.sleep(0.05)


async def test_a_drafter_back_while_no_request_runs_is_readmitted_by_the_health_probe(model):
    """Its breaker opened while a request ran (the drafter was down); then it comes back with nothing running,
    so no step sends the breaker's own probes: the health watcher's answer re-admits it, and Info says serving."""
    from services.drafter.methods.ngram import NgramProposer
    from services.drafter.server import serve

    port = free_port()
    overrides = {"drafters": [f"late=127.0.0.1:{port}"], "drafter_health_interval_s": 0.1}
    async with verifier(model, **overrides) as (running, stub):
        messages = await collect(stub, greedy("g", [1, 2, 3, 1, 2, 3], 8, method="late"))
        assert sum(len(m.token_ids) for m in messages) == 8
        assert running.engine.is_degraded("late")
        server, _ = await serve(NgramProposer(), "127.0.0.1", port)
        try:
            await state_becomes(stub, verifier_pb2.DRAFTER_STATE_SERVING)
            assert not running.engine.is_degraded("late")
        finally:
            await server.server.stop(0)


async def test_idle_drafters_states_follow_the_drafter_coming_and_going(model):
    """No request uses the drafter: the health watcher alone notices it start, then stop."""
    from services.drafter.methods.ngram import NgramProposer
    from services.drafter.server import serve

    port = free_port()
    overrides = {"drafters": [f"late=127.0.0.1:{port}"], "drafter_health_interval_s": 0.1}

    async with verifier(model, **overrides) as (_running, stub):
        assert (await info(stub)).drafters[0].state == verifier_pb2.DRAFTER_STATE_DISCONNECTED
        server, _ = await serve(NgramProposer(), "127.0.0.1", port)
        try:
            await state_becomes(stub, verifier_pb2.DRAFTER_STATE_SERVING)
        finally:
            await server.server.stop(0)
        await state_becomes(stub, verifier_pb2.DRAFTER_STATE_DISCONNECTED)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in the scrape")


async def test_metrics_endpoint_counts_speculation(model, ngram_drafter):
    _, drafter_port = ngram_drafter
    port = free_port()
    overrides = {"drafters": [f"ngram=127.0.0.1:{drafter_port}"], "speculative_config": NGRAM, "metrics_port": port,
                 "adaptive_speculation": False}  # every draft verified, whatever the planner would make of the timings
    async with verifier(model, **overrides) as (running, stub):
        assert running.metrics_port == port
        messages = await collect(stub, greedy("m", repetitive_prompt(random.Random(1), 40), 30))
        final = messages[-1].speculation
        text = await asyncio.to_thread(scrape, port)
    labels = {"model_name": MODEL_ID, "method": "ngram"}
    assert sample(text, "specserve_spec_decode_num_drafts_total", **labels) == final.num_drafts > 0
    assert sample(text, "specserve_spec_decode_num_draft_tokens_total", **labels) == final.num_draft_tokens
    assert sample(text, "specserve_spec_decode_num_accepted_tokens_total", **labels) == final.num_accepted_tokens
    assert sample(text, "specserve_spec_decode_num_accepted_tokens_per_pos_total", position="0", **labels) > 0
    assert sample(text, "specserve_spec_decode_num_fallbacks_total", model_name=MODEL_ID) == 0
    assert sample(text, "specserve_num_requests_running", model_name=MODEL_ID) == 0
    assert sample(text, "specserve_verify_step_seconds_count", model_name=MODEL_ID, kind="verify") > 0
    assert sample(text, "specserve_drafter_round_trip_seconds_count", drafter="ngram") > 0


async def test_a_second_stop_waits_for_the_first_to_end(model):
    """A signal starts the stop; `serve` then stops too on its way out. That second stop used to return at once,
    so the service's loop ended under the first one (the engine's shutdown cancelled half-way)."""
    running = await start_verifier(model, MODEL_ID, settings())
    shutdown, ended = running.engine.shutdown, []

    async def slow_shutdown() -> None:
        await asyncio.sleep(0.2)
        await shutdown()
        ended.append(True)

    running.engine.shutdown = slow_shutdown
    first = asyncio.create_task(running.stop(0, 0.5))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(running.stop(0, 0), 10)
    assert ended and first.done()


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_VERIFIER_PORT", "6000")
    monkeypatch.setenv("SPECSERVE_VERIFIER_MAX_NUM_SEQS", "3")
    parser = argparse.ArgumentParser()
    add_verifier_flags(parser)
    args = parser.parse_args(["--max-num-seqs", "5", "--drafter", "a=h:1", "--drafter", "b=h:2",
                              "--speculative-config", NGRAM, "--metrics-port", "0"])
    parsed = settings_from_args(args)
    assert parsed.port == 6000 and parsed.max_num_seqs == 5 and parsed.metrics_port == 0
    assert parsed.drafter_targets == {"a": "h:1", "b": "h:2"} and parsed.speculation.num_speculative_tokens == 4
    with pytest.raises(ValueError):
        settings_from_args(parser.parse_args(["--drafter", "no-address"]))
    with pytest.raises(ValueError):
        settings_from_args(parser.parse_args(["--speculative-config", "{not json"]))


def test_wire_defaults_follow_the_proto():
    from services.verifier.outputs import FinishReason
    from services.verifier.wire import (
        _FINISH_REASONS,
        DefaultSpeculation,
        finish_reason_from_proto,
        request_from_proto,
    )

    default = DefaultSpeculation("ngram", 4)
    unset = request_from_proto(verifier_pb2.GenerateRequest(prompt_token_ids=[1], sampling={"max_tokens": 3}), "x", default)
    assert (unset.speculation.method, unset.speculation.num_speculative_tokens) == ("ngram", 4)
    assert unset.sampling.top_p == 1.0 and unset.sampling.repetition_penalty == 1.0  # proto3 0 = disabled
    assert unset.sampling.seed is None and unset.sampling.logprobs is None and unset.sampling.greedy
    k2 = request_from_proto(greedy("y", [1], 3, num_speculative_tokens=2), "y", default)
    assert (k2.speculation.method, k2.speculation.num_speculative_tokens) == ("ngram", 2)
    off = request_from_proto(greedy("z", [1], 3, method="none"), "z", default)
    assert not off.speculation.enabled
    assert not request_from_proto(greedy("w", [1], 3), "w", DefaultSpeculation()).speculation.enabled
    seeded = greedy("s", [1], 3)
    seeded.sampling.seed = 0
    assert request_from_proto(seeded, "s", default).sampling.seed == 0  # 0 is a seed, not "unset"
    for reason in (None, *FinishReason):
        assert finish_reason_from_proto(_FINISH_REASONS[reason]) == reason
