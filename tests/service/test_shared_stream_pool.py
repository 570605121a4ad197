"""The gateway's shared GenerateMany calls over several real verifiers (shared_stream_pool.py): requests are spread
over both, a call is renewed once it is old, a verifier that comes up after the calls were made gets its share
within seconds, and a verifier that drains refuses new requests on its call, which go to the other verifier, while
its running request finishes."""

from __future__ import annotations

import asyncio
import contextlib

from services.gateway.shared_stream_pool import SharedStreamPool
from services.gateway.verifier_client import VerifierClient
from services.verifier.server import start_verifier
from tests.ports import free_port
from tests.service.test_generate_many import client_tokens
from tests.service.test_verifier_service import MODEL_ID, collect, greedy, model, settings, verifier, wait_until_idle

__all__ = ["model"]  # the module-scoped tiny model fixture, shared with test_verifier_service


@contextlib.asynccontextmanager
async def two_verifiers(model):
    first = await start_verifier(model, MODEL_ID, settings())
    second = await start_verifier(model, MODEL_ID, settings())
    try:
        yield first, second
    finally:
        await first.stop(0, 0.5)
        await second.stop(0, 0.5)


def served(running) -> int:
    """Tokens the verifier's engine has generated."""
    return sum(running.engine.generated_tokens.values())


async def connected(client: VerifierClient) -> None:
    """The channel has reached its verifiers (as the gateway's start-up Info call does), so that calls made one after
    another go round them."""
    await client.info()
    await asyncio.sleep(0.3)


async def on_both(client: VerifierClient) -> None:
    """The pool's calls reach two verifiers: on a busy machine the second may not have been ready when they were
    made, and the pool then replaces one within seconds (a one-token request at a time lets it pick)."""
    async with asyncio.timeout(20):
        turn = 0
        while len({stream.verifier_id for stream in client._pool.streams} - {None}) < 2:
            await client_tokens(client, greedy(f"warm-{turn}", [1, 2, 3], 1))
            turn += 1
            await asyncio.sleep(0.05)


def prompts(count: int) -> list[list[int]]:
    return [[1 + i, 2 + 2 * i, 3, 5 + i] for i in range(count)]


async def expected_tokens(model, requests) -> list[list[int]]:
    async with verifier(model) as (_, stub):
        return [[t for m in await collect(stub, r) for t in m.token_ids] for r in requests]


async def test_requests_spread_over_the_verifiers_and_get_what_a_call_each_gives(model):
    requests = [greedy(f"r{i}", prompt, 12) for i, prompt in enumerate(prompts(8))]
    expected = await expected_tokens(model, requests)
    async with two_verifiers(model) as (first, second):
        client = VerifierClient(f"127.0.0.1:{first.port},127.0.0.1:{second.port}", shared_stream=True)
        try:
            await connected(client)
            await on_both(client)
            before = served(first), served(second)
            got = await asyncio.gather(*(client_tokens(client, r) for r in requests))
            assert got == expected
            assert len(client._pool.streams) == 2  # one call per listed address, by default
            spread = served(first) - before[0], served(second) - before[1]
            assert min(spread) > 0 and sum(spread) == 8 * 12
        finally:
            await client.close()


async def test_an_old_call_is_replaced_and_closes_once_its_requests_are_done(model):
    async with verifier(model) as (running, stub):
        client = VerifierClient(f"127.0.0.1:{running.port}", shared_stream=True, shared_stream_max_age_s=0.3)
        try:
            assert len(await client_tokens(client, greedy("a", [1, 2, 3], 6))) == 6
            (old,) = client._pool.streams
            await asyncio.sleep(0.4)
            assert len(await client_tokens(client, greedy("b", [4, 5, 6], 6))) == 6
            (new,) = client._pool.streams
            assert new is not old
            async with asyncio.timeout(5):
                while not old._call.done():
                    await asyncio.sleep(0.02)
            assert "the verifier ended" in old.error.details()  # half-closed, then ended by the verifier, not cut
            await wait_until_idle(stub)
        finally:
            await client.close()


async def test_a_draining_verifier_refuses_new_requests_on_its_call_and_finishes_the_one_it_runs(model):
    requests = [greedy(f"n{i}", prompt, 8) for i, prompt in enumerate(prompts(6))]
    long_request = greedy("long", [7, 8, 9], 120)
    expected = await expected_tokens(model, [*requests, long_request])
    async with two_verifiers(model) as (first, second):
        client = VerifierClient(f"127.0.0.1:{first.port},127.0.0.1:{second.port}", shared_stream=True)
        try:
            await connected(client)
            long_tokens: list[int] = []

            async def read_long() -> None:
                async for message in client.generate(long_request):
                    long_tokens.extend(message.token_ids)

            reading = asyncio.create_task(read_long())
            async with asyncio.timeout(5):
                while not long_tokens:
                    await asyncio.sleep(0.01)
            draining = first if first.engine.num_running else second
            other = second if draining is first else first
            calls_before = set(client._pool.streams)
            stopping = asyncio.create_task(draining.stop(drain_s=2.0, grace_s=10.0))
            await asyncio.sleep(0.1)  # NOT_SERVING, and its GenerateMany calls start nothing more
            got = await asyncio.gather(*(client_tokens(client, r) for r in requests))
            assert got == expected[:-1]  # every new request served
            assert set(client._pool.streams) != calls_before  # a request was refused on the draining one's call
            await reading
            assert long_tokens == expected[-1]  # the running request finished where it ran
            assert served(draining) == 120 and served(other) == 6 * 8  # nothing new started on the draining one
            await stopping
        finally:
            await client.close()


async def test_a_verifier_that_comes_up_late_gets_its_share_within_seconds(model):
    """Both calls are made while only the first verifier serves, so both reach it; once the second is up, the pool
    sees two calls on one verifier (their initial metadata) and replaces one, long before the calls' renewal."""
    late_port = free_port()
    first = await start_verifier(model, MODEL_ID, settings())
    client = VerifierClient(f"127.0.0.1:{first.port},127.0.0.1:{late_port}", shared_stream=True,
                            shared_stream_max_age_s=600)
    client._pool.spread_interval_s = 0.2
    late = None
    try:
        await connected(client)
        assert len(await asyncio.gather(*(client_tokens(client, greedy(f"a{i}", [1, 2, i], 6)) for i in range(4)))) == 4
        assert len({stream.verifier_id for stream in client._pool.streams}) == 1  # both calls on the first
        late = await start_verifier(model, MODEL_ID, settings(port=late_port))
        async with asyncio.timeout(20):
            turn = 0
            while not served(late):
                await asyncio.gather(*(client_tokens(client, greedy(f"b{turn}-{i}", [3, 4, i], 4)) for i in range(4)))
                turn += 1
                await asyncio.sleep(0.1)
        assert len({stream.verifier_id for stream in client._pool.streams}) == 2
    finally:
        await client.close()
        await first.stop(0, 0.5)
        if late is not None:
            await late.stop(0, 0.5)


async def test_calls_that_keep_meeting_on_one_verifier_are_replaced_less_and_less_often(model):
    """Two calls and one verifier: the pool replaces one of them after 1 s, then waits 2, 4, then 8 s at most
    between replacements (each replaced call keeps a message a step of its own while its requests run)."""
    now = [0.0]
    pool = SharedStreamPool(2, max_age_s=1000.0, spread_interval_s=1.0, clock=lambda: now[0])
    replaced_at = []
    async with verifier(model) as (_, stub):
        try:
            for second in range(40):
                now[0] = float(second)
                before = set(pool.streams)
                pool.pick(stub)
                if before and set(pool.streams) != before:
                    replaced_at.append(second)
                async with asyncio.timeout(5):
                    while any(stream.verifier_id is None for stream in pool.streams):
                        await asyncio.sleep(0.01)
        finally:
            await pool.close()
    assert replaced_at == [1, 2, 4, 8, 16, 24, 32]
