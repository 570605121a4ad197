"""GenerateMany on a real verifier: many requests on one stream get what Generate gives each of them, in fewer
messages; a refused or failed request ends with its own error and the others go on; an abort, or the call ending,
frees the slots."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from services.verifier.wire import verifier_pb2
from tests.prompts import repetitive_prompt
from tests.service.test_verifier_service import MAX_MODEL_LEN, collect, greedy, info, model, verifier, wait_until_idle

__all__ = ["model"]  # the module-scoped tiny model fixture, shared with test_verifier_service


def start(request) -> verifier_pb2.StreamRequest:
    return verifier_pb2.StreamRequest(start=request)


async def read_all(call) -> tuple[dict[str, list], list[int]]:
    """Every request's updates in order, and how many updates each message carried."""
    updates: dict[str, list] = {}
    sizes = []
    async for message in call:
        sizes.append(len(message.updates))
        for update in message.updates:
            updates.setdefault(update.request_id, []).append(update)
    return updates, sizes


async def test_many_requests_on_one_stream_get_what_generate_gives_each_in_fewer_messages(model):
    rng = random.Random(3)
    requests = [greedy(f"r{i}", repetitive_prompt(rng, 10 + 7 * i), 20) for i in range(4)]
    async with verifier(model) as (_, stub):
        expected = [[t for m in await collect(stub, r) for t in m.token_ids] for r in requests]
        renamed = [greedy(f"many-{r.request_id}", list(r.prompt_token_ids), 20) for r in requests]
        call = stub.GenerateMany(iter([start(r) for r in renamed]), timeout=20)
        updates, sizes = await read_all(call)
    for request, tokens in zip(renamed, expected, strict=True):
        got = updates[request.request_id]
        assert [t for u in got for t in u.output.token_ids] == tokens
        assert got[-1].output.finish_reason == verifier_pb2.FINISH_REASON_LENGTH
        assert got[-1].output.usage.completion_tokens == 20
        assert all(not u.HasField("error") for u in got)
    assert max(sizes) > 1 and len(sizes) < sum(len(u) for u in updates.values())  # steps' outputs share messages


async def test_a_refused_request_ends_alone_and_the_others_run_on(model):
    async with verifier(model) as (_, stub):
        hot = greedy("hot", [1, 2, 3], 4)
        hot.sampling.temperature = -1.0
        no_id = greedy("", [1, 2, 3], 4)
        messages = [start(greedy("ok", [1, 2, 3], 8)), start(greedy("long", [1] * MAX_MODEL_LEN, 4)), start(hot),
                    start(no_id), start(greedy("ok2", [4, 5, 6], 8))]
        updates, _ = await read_all(stub.GenerateMany(iter(messages), timeout=20))
    assert updates["long"][0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt" in updates["long"][0].error.message
    assert updates["hot"][0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "request_id" in updates[""][0].error.message
    for name in ("ok", "ok2"):
        assert sum(len(u.output.token_ids) for u in updates[name]) == 8
        assert updates[name][-1].output.finish_reason == verifier_pb2.FINISH_REASON_LENGTH


async def test_a_full_queue_and_an_engine_failure_fail_their_requests_only(model):
    async with verifier(model, max_num_seqs=1, max_waiting_requests=0) as (running, stub):
        sent: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (message := await sent.get()) is not None:
                yield message

        # "a" must still be running when its abort arrives: a step takes at least 20 ms, so its 150 tokens take 3 s
        # or more, where the test sends the abort within a few steps (under fresh-clone-check's load, unpaced, "a"
        # once finished before its abort was sent, and the test waited for an abort that had nothing to end)
        forward = running.engine.runner.forward
        running.engine.runner.forward = lambda rows: (time.sleep(0.02), forward(rows))[1]
        call = stub.GenerateMany(requests(), timeout=20)
        sent.put_nowait(start(greedy("a", [1, 2, 3], 150)))
        first = await call.read()
        assert first.updates[0].request_id == "a"
        sent.put_nowait(start(greedy("b", [1, 2, 3], 4)))  # no slot and no room to wait
        refused, last = None, first.updates[0]
        while refused is None:
            message = await call.read()
            refused = next((u for u in message.updates if u.request_id == "b"), None)
            last = next((u for u in message.updates if u.request_id == "a"), last)
        assert refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert last.output.finish_reason == verifier_pb2.FINISH_REASON_UNSPECIFIED, "a ended before its abort"
        sent.put_nowait(verifier_pb2.StreamRequest(abort="a"))
        while last.output.finish_reason == verifier_pb2.FINISH_REASON_UNSPECIFIED:
            message = await call.read()
            last = next((u for u in message.updates if u.request_id == "a"), last)
        assert last.output.finish_reason == verifier_pb2.FINISH_REASON_ABORT
        await wait_until_idle(stub)

        def broken_forward(rows):
            raise RuntimeError("device fell over")

        running.engine.runner.forward = broken_forward
        sent.put_nowait(start(greedy("x", [1, 2, 3], 4)))
        failed = None
        while failed is None:
            message = await call.read()
            failed = next((u for u in message.updates if u.request_id == "x"), None)
        assert failed.error.code == grpc.StatusCode.INTERNAL.value[0] and "device fell over" in failed.error.message
        sent.put_nowait(None)  # half-close: nothing runs, so the stream ends
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


async def test_cancelling_the_call_aborts_every_request_on_it(model):
    async with verifier(model) as (running, stub):
        aborted = []
        engine_abort = running.engine.abort
        running.engine.abort = lambda request_id: aborted.append((request_id, engine_abort(request_id))) or True
        sent: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (message := await sent.get()) is not None:
                yield message

        call = stub.GenerateMany(requests(), timeout=20)
        for name in ("c1", "c2"):
            sent.put_nowait(start(greedy(name, [1, 2, 3], MAX_MODEL_LEN - 4)))
        seen: set[str] = set()
        while seen != {"c1", "c2"}:
            seen |= {u.request_id for u in (await call.read()).updates}
        assert (await info(stub)).num_running == 2
        call.cancel()
        await wait_until_idle(stub)
        assert sorted(aborted) == [("c1", True), ("c2", True)]


async def client_tokens(client, request) -> list[int]:
    return [t async for message in client.generate(request) for t in message.token_ids]


async def test_the_gateways_shared_stream_gives_what_a_call_each_gives_and_aborts_what_it_leaves(model):
    """VerifierClient(shared_stream=True): requests over one GenerateMany call; a request the gateway stops reading
    (a stop string, a client gone) is aborted on the verifier; a refusal is the Generate call's status."""
    from contextlib import aclosing

    from services.gateway.verifier_client import VerifierClient

    rng = random.Random(5)
    requests = [greedy(f"s{i}", repetitive_prompt(rng, 12 + 5 * i), 16) for i in range(5)]
    async with verifier(model) as (running, stub):
        separate = VerifierClient(f"127.0.0.1:{running.port}")
        shared = VerifierClient(f"127.0.0.1:{running.port}", shared_stream=True)
        try:
            expected = [await client_tokens(separate, r) for r in requests]
            renamed = [greedy(f"shared-{r.request_id}", list(r.prompt_token_ids), 16) for r in requests]
            assert await asyncio.gather(*(client_tokens(shared, r) for r in renamed)) == expected

            async with aclosing(shared.generate(greedy("left", [1, 2, 3], MAX_MODEL_LEN - 4))) as stream:
                await anext(stream)
                assert (await info(stub)).num_running == 1
            await wait_until_idle(stub)  # the abort reached the verifier

            too_long = greedy("too-long", [1] * MAX_MODEL_LEN, 4)
            try:
                await client_tokens(shared, too_long)
                raise AssertionError("a prompt over max_model_len was served")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in error.details()
            assert await client_tokens(shared, renamed[0]) == expected[0]  # the stream still serves
        finally:
            await shared.close()
            await separate.close()


@pytest.mark.parametrize("after_first_message", [False, True])
async def test_a_shared_stream_that_breaks_is_replaced_and_a_request_with_nothing_yet_retried(model, monkeypatch,
                                                                                            after_first_message):
    """The verifier's side of the call ends UNAVAILABLE (a connection lost): a request that had received nothing
    goes out again, once, on a fresh channel's call, and is served; one that had tokens fails (they were sent on)."""
    from services.gateway.verifier_client import VerifierClient
    from services.verifier.servicer import VerifierServicer

    generate_many, calls = VerifierServicer.GenerateMany, []

    async def breaking_once(self, requests, context):
        calls.append(1)
        sent = 0
        async for message in generate_many(self, requests, context):
            if len(calls) == 1 and sent == int(after_first_message):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            sent += 1
            yield message
        if len(calls) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    monkeypatch.setattr(VerifierServicer, "GenerateMany", breaking_once)
    async with verifier(model) as (running, stub):
        client = VerifierClient(f"127.0.0.1:{running.port}", shared_stream=True)
        channel = None
        try:
            request = greedy("r", [1, 2, 3], 6)
            if after_first_message:
                try:
                    await client_tokens(client, request)
                    raise AssertionError("a request that had tokens was retried")
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                assert len(calls) == 1
            else:
                await client.info()  # opens the channel
                channel = client._channel
                assert channel is not None and len(await client_tokens(client, request)) == 6
                assert len(calls) == 2 and client._channel is not channel  # a fresh channel's call
            assert len(await client_tokens(client, greedy("next", [4, 5, 6], 6))) == 6  # and the next one works
            await wait_until_idle(stub)
        finally:
            await client.close()


async def test_a_draining_verifier_ends_an_idle_call_at_once_and_a_busy_one_when_its_requests_are_done(model):
    """Draining, a call starts no more requests; one its client keeps open used to last until the server's grace ran
    out, and was cancelled then (grpc logged it at every shutdown)."""
    async with verifier(model) as (running, stub):
        expected = [t for m in await collect(stub, greedy("alone", [1, 2, 3], 40)) for t in m.token_ids]
        idle, busy = stub.GenerateMany(), stub.GenerateMany()
        await busy.write(start(greedy("long", [1, 2, 3], 40)))
        first = await asyncio.wait_for(busy.read(), 10)
        running.servicer.drain()
        assert await asyncio.wait_for(idle.read(), 5) == grpc.aio.EOF
        assert await idle.code() == grpc.StatusCode.OK
        messages = [first]
        while (message := await asyncio.wait_for(busy.read(), 20)) != grpc.aio.EOF:
            messages.append(message)
        assert await busy.code() == grpc.StatusCode.OK
    tokens = [t for m in messages for u in m.updates for t in u.output.token_ids]
    assert tokens == expected
