"""RemoteProposer against real drafter servers: it refuses a drafter with another vocabulary, re-opens
sequences a drafter lost, and sends each committed token once."""

from __future__ import annotations

import asyncio

import pytest

from services.common.drafter_wire import DrafterDescription, DraftStep, drafter_pb2_grpc
from services.common.grpc_server import start_grpc_server
from services.common.proposer import DraftInput, ProposerCapabilities
from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.drafter.server import SERVICE_NAME, serve
from services.drafter.servicer import DrafterServicer, LinkState
from services.verifier.remote_proposer import IncompatibleDrafterError, RemoteProposer, RemoteProposerConfig
from tests.tiny_models import VOCAB

A = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]


async def test_a_drafter_with_another_vocabulary_is_refused():
    server, port = await serve(NgramProposer(), "127.0.0.1", 0, vocab_size=VOCAB + 1)
    config = RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB)
    try:
        with pytest.raises(IncompatibleDrafterError, match=rf"vocabulary of {VOCAB + 1} tokens.*has {VOCAB}"):
            await RemoteProposer.connect(config)
        remote = RemoteProposer(config)  # used without connect: every propose refuses, the engine runs K = 0
        with pytest.raises(IncompatibleDrafterError):
            await remote.propose([DraftInput("a", A, 3)])
        await remote.close()
    finally:
        await server.server.stop(0)


async def test_a_drafter_with_another_tokenizer_is_refused():
    server, port = await serve(NgramProposer(), "127.0.0.1", 0, vocab_size=VOCAB, tokenizer_fingerprint="a" * 64)
    try:
        for ours, refused in (("b" * 64, True), ("a" * 64, False), ("", False)):
            config = RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB, tokenizer_fingerprint=ours)
            if refused:
                with pytest.raises(IncompatibleDrafterError, match="different tokenizer"):
                    await RemoteProposer.connect(config)
            else:
                await (await RemoteProposer.connect(config)).close()
    finally:
        await server.server.stop(0)


async def test_same_vocabulary_or_none_declared_is_accepted():
    for declared in (0, VOCAB):
        server, port = await serve(NgramProposer(), "127.0.0.1", 0, vocab_size=declared)
        try:
            remote = await RemoteProposer.connect(RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB))
            assert remote.method == "ngram"
            await remote.close()
        finally:
            await server.server.stop(0)


class ForgetfulServicer(DrafterServicer):
    """Loses all sequence state before every other step (as a drafter that evicted them would), and records
    what arrives, so the test sees both the resync answers and the re-sent sequences."""

    def __init__(self) -> None:
        super().__init__(
            NgramProposer(NgramSettings(1, 3)), DrafterDescription("ngram", ProposerCapabilities(max_speculative_tokens=5))
        )
        self.steps: list[DraftStep] = []

    async def _step(self, link: LinkState, step: DraftStep):
        self.steps.append(step)
        if len(self.steps) % 2 == 0:
            link.sequences.clear()
        return await super()._step(link, step)


async def test_resync_re_sends_the_whole_sequence_and_closed_ids_travel():
    servicer = ForgetfulServicer()
    server = await start_grpc_server(
        lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), [SERVICE_NAME]
    )
    remote = await RemoteProposer.connect(RemoteProposerConfig(f"127.0.0.1:{server.port}", VOCAB))
    try:
        reference = NgramProposer(NgramSettings(1, 3))
        tokens = list(A)
        (first,) = await remote.propose([DraftInput("a", tuple(tokens), 3)])
        assert list(first.token_ids) == list(
            (await reference.propose([DraftInput("a", tokens, 3)]))[0].token_ids
        )
        tokens.append(7)
        (lost,) = await remote.propose(
            [DraftInput("a", tuple(tokens), 3)]
        )  # drafter forgot: resync, no draft
        assert list(lost.token_ids) == []
        tokens.append(8)
        (again,) = await remote.propose([DraftInput("a", tuple(tokens), 3)])
        assert list(again.token_ids) == list(
            (await reference.propose([DraftInput("a", tokens, 3)]))[0].token_ids
        )
        sent = [(u.base_length, len(u.new_token_ids)) for s in servicer.steps for u in s.updates]
        assert sent == [(0, len(A)), (len(A), 1), (0, len(A) + 2)]  # only new tokens, then the whole sequence
        remote.release("a")
        await remote.propose([DraftInput("b", (1, 2, 1), 2)])
        assert servicer.steps[-1].closed_seq_ids == ("a",)
    finally:
        await remote.close()
        await server.server.stop(0)


async def test_a_drafter_that_dies_with_an_open_link_is_unavailable_not_an_unexpected_error():
    """The verifier logged a traceback for grpc.aio's InvalidStateError ("RPC already finished") when the drafter
    process died between two steps; that is an outage like any other (DrafterUnavailableError: a ConnectionError)."""
    server, port = await serve(NgramProposer(NgramSettings(1, 3)), "127.0.0.1", 0)
    remote = await RemoteProposer.connect(RemoteProposerConfig(f"127.0.0.1:{port}", VOCAB, step_timeout_s=2.0))
    try:
        await remote.propose([DraftInput("a", tuple(A), 3)])
        await server.server.stop(0)
        await asyncio.sleep(0.5)  # the link's call has finished before the next step writes to it
        errors = []
        for step in range(3):
            remote._retry_at = 0.0  # skip the backoff: each step tries the link again
            try:
                await remote.propose([DraftInput("a", (*A, *range(step + 1)), 3)])
            except Exception as error:  # noqa: BLE001 - collected and checked below
                errors.append(error)
        assert len(errors) == 3 and all(isinstance(e, ConnectionError) for e in errors), errors
    finally:
        await remote.close()
