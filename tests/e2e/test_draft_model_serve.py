"""`specserve serve` with the draft_model method, as the issue's user starts it: one command, a target and a draft
model named in `--speculative-config`, the OpenAI SDK as the client.

The draft model is the target itself (SmolLM2-135M, the only real model the test suite installs): a pair that
agrees on every greedy token, so the drafts must be accepted, and any mix-up of positions between the drafter's
KV cache and the verifier's committed tokens would show as rejections or as changed output."""

from __future__ import annotations

import json

import openai
import pytest

from services.soak.serve_process import ServeProcess
from tests.e2e.requests import MODEL, NO_SPEC, at_once
from tests.e2e.stack import serve_ports

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


@pytest.fixture(scope="module")
def draft_model_stack(tmp_path_factory):
    spec = json.dumps({"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4,
                       "draft_max_num_seqs": 4, "max_model_len": 1024})
    # Every draft verified (--no-adaptive-speculation): a model drafting for itself on the same two cores costs about
    # what its drafts win, so the planner may rightly ask it for nothing, and these tests are of the serving, not of
    # that choice (test_adaptive_speculation.py and test_draft_cost.py test it)
    stack = ServeProcess(tmp_path_factory.mktemp("logs") / "serve.log", max_num_seqs=4,
                         extra_flags=["--speculative-config", spec, "--no-adaptive-speculation"], ports=serve_ports())
    try:
        yield stack.start()
    finally:
        stack.stop()


def _chat(stack: ServeProcess, **extra):
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=48, **extra
    )


def test_serve_drafts_with_the_draft_model_and_greedy_output_is_unchanged(draft_model_stack):
    drafted, plain = at_once(lambda: _chat(draft_model_stack, temperature=0),
                             lambda: _chat(draft_model_stack, temperature=0, extra_body=NO_SPEC))
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    spec = drafted.model_extra["speculative_decoding"]
    assert spec["method"] == "draft_model" and spec["num_drafts"] > 0, spec
    # The target drafting for itself: every greedy draft token is the target's own choice.
    assert spec["acceptance_rate"] == pytest.approx(1.0), spec
    assert plain.model_extra["speculative_decoding"]["num_drafts"] == 0
    log = draft_model_stack.log()
    assert "drafter (draft_model) listening" in log
    assert "draft model" in log and "sequences of up to" in log  # the drafter loaded its own model and runner
    assert log.count("model forwards run on the") == 2  # verifier and drafter each placed their forwards


def test_per_request_k_and_sampling_work_with_the_draft_model(draft_model_stack):
    narrow, first, again = at_once(
        lambda: _chat(draft_model_stack, temperature=0,
                      extra_body={"speculative_config": {"num_speculative_tokens": 1}}),
        lambda: _chat(draft_model_stack, temperature=0.8, seed=7),
        lambda: _chat(draft_model_stack, temperature=0.8, seed=7))  # in the same steps: the seed alone decides
    spec = narrow.model_extra["speculative_decoding"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == spec["num_drafts"], spec  # one token per draft
    assert first.choices[0].message.content == again.choices[0].message.content  # seeded sampling is reproducible
    assert first.model_extra["speculative_decoding"]["num_drafts"] > 0


def test_per_request_draft_pipelining_keeps_greedy_output_and_is_refused_without_a_model_drafter(draft_model_stack):
    pipelined, plain = at_once(
        lambda: _chat(draft_model_stack, temperature=0,
                      extra_body={"speculative_config": {"draft_pipelining": True}}),
        lambda: _chat(draft_model_stack, temperature=0, extra_body=NO_SPEC))
    assert pipelined.choices[0].message.content == plain.choices[0].message.content
    assert pipelined.model_extra["speculative_decoding"]["num_drafts"] > 0
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(draft_model_stack, extra_body={"speculative_config": {"method": "none", "draft_pipelining": True}})
    assert "draft_pipelining" in refused.value.message
