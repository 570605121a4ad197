"""One suffix drafter, two verifiers: an answer finished through verifier A makes the same request through
verifier B draft better from its first step, because the drafter's global tree of responses is shared by every
verifier connected to it (an engine with an in-process suffix cache cannot share it across replicas).

Real parts: two Verifier gRPC services on free ports around a tiny model, one Drafter gRPC service with
arctic-inference's suffix tree, greedy requests over gRPC."""

from __future__ import annotations

import contextlib
import random

import grpc
import pytest

from services.drafter.methods.suffix import SuffixProposer, SuffixSettings
from services.drafter.server import serve
from services.verifier.server import start_verifier
from services.verifier.settings import VerifierSettings
from services.verifier.wire import verifier_pb2, verifier_pb2_grpc
from tests.tiny_models import VOCAB, tiny_llama

K = 8
SUFFIX = f'{{"method": "suffix", "num_speculative_tokens": {K}}}'
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


@contextlib.asynccontextmanager
async def suffix_drafter():
    server, port = await serve(SuffixProposer(SuffixSettings()), "127.0.0.1", 0, num_speculative_tokens=K)
    try:
        yield port
    finally:
        await server.server.stop(0)


@contextlib.asynccontextmanager
async def verifier(model, drafter_port: int):
    settings = VerifierSettings(port=0, metrics_port=0, max_num_seqs=2, max_model_len=200, draft_timeout_s=2.0,
                                log_stats_interval_s=0, drafters=[f"suffix=127.0.0.1:{drafter_port}"],
                                speculative_config=SUFFIX, adaptive_speculation=False)  # counts compare drafters
    running = await start_verifier(model, "tiny-llama", settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield verifier_pb2_grpc.VerifierStub(channel)
    finally:
        await running.stop(0, 0.5)


async def generate(stub, request_id: str, prompt: list[int]) -> tuple[list[int], verifier_pb2.SpeculationStats]:
    request = verifier_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=verifier_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        speculation=verifier_pb2.SpeculationParams(method="suffix", num_speculative_tokens=K),
    )
    messages = [m async for m in stub.Generate(request, timeout=30)]
    return [t for m in messages for t in m.token_ids], messages[-1].speculation


async def test_an_answer_through_one_verifier_speeds_up_the_same_request_through_another(model):
    rng = random.Random(11)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]  # random: the request's own tree drafts little at first
    async with suffix_drafter() as shared, verifier(model, shared) as a, verifier(model, shared) as b:
        tokens_a, stats_a = await generate(a, "through-a", prompt)
        tokens_b, stats_b = await generate(b, "through-b", prompt)
    async with suffix_drafter() as fresh_port, verifier(model, fresh_port) as c:
        tokens_c, stats_c = await generate(c, "fresh-drafter", prompt)

    assert tokens_a == tokens_b == tokens_c, "greedy output does not depend on what the drafter knows"
    assert stats_b.method == "suffix" and stats_b.num_accepted_tokens > 0
    # B drafts A's whole answer from its first step; a drafter without that history only finds the repeats that
    # the answer itself builds up, as A's did.
    # (seen: B 41 accepted in 6 drafts, C 19 in 18)
    assert stats_b.num_accepted_tokens >= stats_c.num_accepted_tokens + MAX_TOKENS // 4, (stats_b, stats_c)
    assert stats_b.num_drafts <= stats_c.num_drafts // 2, "fewer, longer steps"
    assert stats_a.num_accepted_tokens == stats_c.num_accepted_tokens, "A ran with no history, as C did"
