"""OpenAI's predicted outputs on /v1/chat/completions, through the official SDK against a scripted verifier: the
prediction reaches the verifier as the token ids its "prediction" method drafts from, usage says how much of it was
accepted and rejected, and what cannot be used is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from services.common.drafter_methods import PREDICTION

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Rename x to y: x = 1"}]


@pytest.fixture
def sdk(served):
    return openai.OpenAI(base_url=served() + "/v1", api_key="unused", max_retries=0)


def test_the_prediction_is_drafted_from_and_usage_counts_what_it_gave(sdk, verifier):
    reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES,
                                        prediction={"type": "content", "content": "y = 1 ✓"})
    sent = verifier.requests[-1].speculation
    assert sent.method == PREDICTION and list(sent.prediction_token_ids) == list("y = 1 ✓".encode())
    details = reply.usage.completion_tokens_details  # the scripted verifier's stats: 3 drafted a step
    stats = reply.model_extra["speculative_decoding"]  # this server's extension
    assert details.accepted_prediction_tokens == stats["num_accepted_tokens"] > 0
    assert details.rejected_prediction_tokens == stats["num_draft_tokens"] - stats["num_accepted_tokens"]
    assert stats["method"] == PREDICTION

    streamed = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                           stream_options={"include_usage": True},
                                           prediction={"type": "content", "content": [
                                               {"type": "text", "text": "y = "}, {"type": "text", "text": "1"}]})
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None][-1]
    assert list(verifier.requests[-1].speculation.prediction_token_ids) == list(b"y = 1")
    assert usage.completion_tokens_details.accepted_prediction_tokens == details.accepted_prediction_tokens

    plain = sdk.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert plain.usage.completion_tokens_details is None  # no prediction, nothing to count
    assert list(verifier.requests[-1].speculation.prediction_token_ids) == []
    sdk.chat.completions.create(model=MODEL, messages=MESSAGES, prediction={"type": "content", "content": ""})
    sent = verifier.requests[-1].speculation  # an empty prediction predicts nothing: the server's drafter drafts
    assert sent.method == "" and list(sent.prediction_token_ids) == []


@pytest.mark.parametrize(("route", "body", "said"), [
    ("chat", {"prediction": {"type": "text", "content": "y"}}, "prediction.type"),
    ("chat", {"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}},
     "prediction.content"),
    ("chat", {"prediction": {"type": "content", "content": "y" * 300}}, "longer than the model's context (256)"),
    ("chat", {"prediction": {"type": "content", "content": "y"}, "speculative_config": {"method": "ngram"}},
     "speculative_config.method 'ngram' would replace"),
    ("completions", {"prediction": {"type": "content", "content": "y"}},
     "predicted outputs are supported on /v1/chat/completions only"),
])
def test_a_prediction_that_cannot_be_used_is_a_400_naming_it(sdk, verifier, route, body, said):
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "chat":
            sdk.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body)
        else:
            sdk.completions.create(model=MODEL, prompt="x", extra_body=body)
    assert said in refused.value.message and "prediction" in refused.value.message
    assert not verifier.requests
