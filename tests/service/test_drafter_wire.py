"""The Draft stream as a verifier sees it on the wire: proposals equal the in-process proposer's, a stale base
length asks for a resync, closed and abandoned sequences are forgotten (and released in the proposer)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import grpc
import torch

from services.common.drafter_wire import (
    DrafterDescription,
    DraftReply,
    DraftStep,
    SequenceDraft,
    SequenceUpdate,
    decode_probs,
    dense_probs,
    description_from_proto,
    description_to_proto,
    drafter_pb2,
    drafter_pb2_grpc,
    encode_probs,
    probs_support,
    reply_from_proto,
    reply_to_proto,
    step_from_proto,
    step_to_proto,
)
from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.drafter.methods.ngram import NgramProposer, NgramSettings
from services.drafter.server import serve

A = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
B = [1, 2, 3, 1, 2, 3, 1, 2]
TIMEOUT_S = 10.0


def update(seq_id, base, tokens, k):
    return drafter_pb2.SequenceUpdate(
        seq_id=seq_id, base_length=base, new_token_ids=tokens, num_speculative_tokens=k
    )


async def expected(tokens: Sequence[int], k: int) -> list[int]:
    (draft,) = await NgramProposer(NgramSettings(1, 3)).propose([DraftInput("x", tokens, k)])
    return list(draft.token_ids)


async def exchange(call, request):
    await call.write(request)
    return await call.read()


async def test_open_two_sequences_then_extend(ngram_drafter):
    _, port = ngram_drafter
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = drafter_pb2_grpc.DrafterStub(channel).Draft(timeout=TIMEOUT_S)
        reply = await exchange(
            call, drafter_pb2.DraftRequest(step_id=1, updates=[update("a", 0, A, 3), update("b", 0, B, 5)])
        )
        assert reply.step_id == 1
        assert [d.seq_id for d in reply.drafts] == ["a", "b"]
        assert list(reply.drafts[0].token_ids) == await expected(A, 3) != []
        assert list(reply.drafts[1].token_ids) == await expected(B, 5) != []
        assert [d.base_length for d in reply.drafts] == [len(A), len(B)]
        assert not any(d.resync_needed for d in reply.drafts)

        # only the newly committed tokens travel; the drafter drafts from the whole sequence
        reply = await exchange(
            call, drafter_pb2.DraftRequest(step_id=2, updates=[update("a", len(A), [7], 4)])
        )
        assert reply.step_id == 2 and reply.drafts[0].base_length == len(A) + 1
        assert list(reply.drafts[0].token_ids) == await expected(A + [7], 4)

        # K above the drafter's max is clamped; K = 0 only records tokens
        reply = await exchange(
            call, drafter_pb2.DraftRequest(step_id=3, updates=[update("b", len(B), [], 9)])
        )
        assert len(reply.drafts[0].token_ids) <= 5
        reply = await exchange(
            call, drafter_pb2.DraftRequest(step_id=4, updates=[update("b", len(B), [3], 0)])
        )
        assert list(reply.drafts[0].token_ids) == [] and reply.drafts[0].base_length == len(B) + 1
        call.cancel()


async def test_stale_base_length_asks_for_resync_and_drops_state(ngram_drafter):
    _, port = ngram_drafter
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = drafter_pb2_grpc.DrafterStub(channel).Draft(timeout=TIMEOUT_S)
        await exchange(call, drafter_pb2.DraftRequest(step_id=1, updates=[update("a", 0, A, 3)]))
        reply = await exchange(
            call, drafter_pb2.DraftRequest(step_id=2, updates=[update("a", len(A) + 2, [1], 3)])
        )
        (draft,) = reply.drafts
        assert draft.resync_needed and list(draft.token_ids) == []
        # the state is gone: even the right length is now unknown ...
        reply = await exchange(
            call, drafter_pb2.DraftRequest(step_id=3, updates=[update("a", len(A), [1], 3)])
        )
        assert reply.drafts[0].resync_needed
        # ... until the verifier re-opens the sequence
        reply = await exchange(
            call, drafter_pb2.DraftRequest(step_id=4, updates=[update("a", 0, A + [1], 3)])
        )
        assert not reply.drafts[0].resync_needed
        assert list(reply.drafts[0].token_ids) == await expected(A + [1], 3)
        # never opened at all
        reply = await exchange(call, drafter_pb2.DraftRequest(step_id=5, updates=[update("zz", 4, [1], 3)]))
        assert reply.drafts[0].resync_needed
        call.cancel()


class RecordingProposer(NgramProposer):
    def __init__(self) -> None:
        super().__init__(NgramSettings(1, 3))
        self.released: list[Hashable] = []
        self.seen: list[Hashable] = []

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        self.seen += [item.seq_id for item in inputs]
        return await super().propose(inputs)

    def release(self, seq_id: Hashable) -> None:
        self.released.append(seq_id)


async def test_closed_and_abandoned_sequences_are_forgotten_and_released():
    proposer = RecordingProposer()
    server, port = await serve(proposer, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = drafter_pb2_grpc.DrafterStub(channel).Draft(timeout=TIMEOUT_S)
            await exchange(
                call,
                drafter_pb2.DraftRequest(step_id=1, updates=[update("a", 0, A, 2), update("b", 0, B, 2)]),
            )
            reply = await exchange(
                call,
                drafter_pb2.DraftRequest(
                    step_id=2, closed_seq_ids=["a"], updates=[update("b", len(B), [3], 2)]
                ),
            )
            assert not reply.drafts[0].resync_needed
            assert len(proposer.released) == 1 and proposer.released[0][1] == "a"
            reply = await exchange(
                call, drafter_pb2.DraftRequest(step_id=3, updates=[update("a", len(A), [], 2)])
            )
            assert reply.drafts[0].resync_needed  # "a" is forgotten
            # a second link may reuse ids: the proposer sees them namespaced per link
            other = drafter_pb2_grpc.DrafterStub(channel).Draft(timeout=TIMEOUT_S)
            reply = await exchange(other, drafter_pb2.DraftRequest(step_id=1, updates=[update("b", 0, B, 2)]))
            assert not reply.drafts[0].resync_needed
            assert len({key for key in proposer.seen if key[1] == "b"}) == 2
            call.cancel()  # the verifier goes away: its open sequence ("b") is released
            other.cancel()
            for _ in range(100):
                if len(proposer.released) == 3:
                    break
                await server.server.wait_for_termination(timeout=0.02)
            assert sorted(key[1] for key in proposer.released) == ["a", "b", "b"]
    finally:
        await server.server.stop(0)


def test_wire_round_trip_keeps_everything():
    step = DraftStep(7, (SequenceUpdate("s", 3, (4, 5), 2), SequenceUpdate("t", 0, (1,), 0)), ("gone",))
    assert step_from_proto(step_to_proto(step)) == step
    for pipelining in (True, False, None):  # None (unset) is the drafter's own setting, not False
        update = SequenceUpdate("s", 3, (4, 5), 2, draft_pipelining=pipelining)
        assert step_from_proto(step_to_proto(DraftStep(8, (update,)))).updates == (update,)
    sampled = SequenceUpdate("s", 3, (4, 5), 2, temperature=0.75)  # a request's temperature, for q-trees
    assert step_from_proto(step_to_proto(DraftStep(9, (sampled,)))).updates == (sampled,)
    for pre_drafts, sends_trees in ((True, False), (False, True)):
        declared = ProposerCapabilities(11, "f", max_speculative_tokens=4, pre_drafts=pre_drafts,
                                        sends_trees=sends_trees)
        info = DrafterDescription("draft_model", declared)
        assert description_from_proto(description_to_proto(info)) == info
    probs = torch.softmax(torch.randn(2, 11), dim=-1)
    reply = reply_from_proto(
        reply_to_proto(
            DraftReply(7, (SequenceDraft("s", 5, (1, 2), probs), SequenceDraft("t", 1, resync_needed=True)))
        )
    )
    assert reply.step_id == 7 and reply.drafts[0].token_ids == (1, 2) and reply.drafts[1].resync_needed
    assert reply.drafts[0].probs.shape == (2, 11) and torch.allclose(reply.drafts[0].probs, probs, atol=1e-3)
    assert reply.drafts[1].probs is None
    assert decode_probs(encode_probs(probs), 3) is None  # not a whole [3, V] matrix: ignored
    tree = SequenceDraft("s", 5, (1, 2, 3), parents=(-1, -1, 0), path_probs=(0.5, 0.25, 0.125))
    assert reply_from_proto(reply_to_proto(DraftReply(8, (tree,)))).drafts == (tree,)


def test_q_over_a_reduced_vocabulary_travels_as_its_support():
    """A drafter whose q covers a few tokens (a reduced vocabulary) sends those columns and their ids; the verifier
    gets the whole [rows, V] back, zero elsewhere; a q over most of the vocabulary goes whole; ids past the
    vocabulary make the q unusable (None: the drafts count as deterministic)."""
    vocab = 40
    q = torch.zeros(3, vocab)
    q[:, [2, 7, 31]] = torch.softmax(torch.randn(3, 3), dim=-1).half().float()
    sent, ids = probs_support(q)
    assert ids == (2, 7, 31) and sent.shape == (3, 3)
    reply = reply_from_proto(reply_to_proto(DraftReply(1, (SequenceDraft("s", 4, (2, 7, 31), sent,
                                                                          probs_token_ids=ids),))))
    received = reply.drafts[0]
    assert received.probs_token_ids == ids and torch.equal(dense_probs(received.probs, ids, vocab), q)
    whole = torch.softmax(torch.randn(2, vocab), dim=-1)
    assert probs_support(whole) == (whole, ()) and dense_probs(whole, (), vocab) is whole
    assert dense_probs(sent, (2, 7, 45), vocab) is None and dense_probs(sent, (2, 7), vocab) is None
    assert probs_support(None) == (None, ())
