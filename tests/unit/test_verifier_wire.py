"""What the verifier sends for one output (wire.output_to_proto): every field of the output, and nothing in the
repeated fields when there is nothing to send."""

from __future__ import annotations

import pytest

from services.verifier.outputs import FinishReason, RequestOutput, SpecDecodeCounts, TokenLogprob
from services.verifier.wire import finish_reason_from_proto, output_to_proto


def test_a_plain_output_carries_its_tokens_usage_and_counts_and_no_logprobs():
    output = RequestOutput(request_id="r", token_ids=(5, 6, 7), logprobs=None, finish_reason=None,
                           num_prompt_tokens=300, num_output_tokens=12, num_cached_tokens=16,
                           spec=SpecDecodeCounts(2, 8, 5))
    message = output_to_proto(output, "ngram")
    assert list(message.token_ids) == [5, 6, 7]
    assert finish_reason_from_proto(message.finish_reason) is None
    assert (message.usage.prompt_tokens, message.usage.completion_tokens, message.usage.cached_tokens) == (300, 12, 16)
    stats = message.speculation
    assert (stats.method, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == ("ngram", 2, 8, 5)
    assert len(message.logprobs) == 0 and len(message.prompt_logprobs) == 0
    assert not message.HasField("stop_token_id")


def test_logprobs_prompt_logprobs_and_the_stop_token_go_out_in_order():
    logprobs = (TokenLogprob(5, -0.5, ((5, -0.5), (9, -1.5))), TokenLogprob(2, -0.1))
    prompt = (TokenLogprob(11, -3.0, ((4, -0.2),), rank=7),)
    output = RequestOutput(request_id="r", token_ids=(5, 2), logprobs=logprobs, finish_reason=FinishReason.STOP,
                           num_prompt_tokens=2, num_output_tokens=2, prompt_logprobs=prompt, stop_token_id=2)
    message = output_to_proto(output, "")
    assert finish_reason_from_proto(message.finish_reason) is FinishReason.STOP
    assert message.stop_token_id == 2 and message.speculation.method == ""
    sent = [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in message.logprobs]
    assert sent == [(5, -0.5, [(5, -0.5), (9, -1.5)]), (2, pytest.approx(-0.1), [])]
    assert [(e.token_id, e.logprob, e.rank, [(t.token_id, t.logprob) for t in e.top])
            for e in message.prompt_logprobs] == [(11, -3.0, 7, [(4, pytest.approx(-0.2))])]


def test_a_generate_many_message_carries_each_output_as_generate_sends_it_and_each_error():
    import grpc

    from services.verifier.request_mux import Update
    from services.verifier.wire import updates_to_proto, verifier_pb2

    logprobs = (TokenLogprob(5, -0.5, ((5, -0.5), (9, -1.5))),)
    outputs = [RequestOutput(request_id="a", token_ids=(5,), logprobs=logprobs, finish_reason=None,
                             num_prompt_tokens=3, num_output_tokens=1, spec=SpecDecodeCounts(1, 4, 0)),
               RequestOutput(request_id="b", token_ids=(7, 8), logprobs=None, finish_reason=FinishReason.LENGTH,
                             num_prompt_tokens=9, num_output_tokens=20, num_cached_tokens=8, stop_token_id=None)]
    updates = [Update("a", "ngram", outputs[0]), Update("e", "", RuntimeError("boom")), Update("b", "", outputs[1])]
    message = updates_to_proto(updates, lambda error: (grpc.StatusCode.INTERNAL, f"failed: {error}"))
    assert [u.request_id for u in message.updates] == ["a", "e", "b"]
    assert message.updates[0].output == output_to_proto(outputs[0], "ngram")
    assert message.updates[2].output == output_to_proto(outputs[1], "")
    assert message.updates[1].error == verifier_pb2.RequestError(code=grpc.StatusCode.INTERNAL.value[0],
                                                                 message="failed: boom")
    assert not message.updates[1].HasField("output") and not message.updates[0].HasField("error")
