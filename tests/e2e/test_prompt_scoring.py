"""Scoring prompts through the whole stack (drafter, verifier with SmolLM2-135M, gateway) with the real OpenAI SDK,
the way lm-evaluation-harness's `local-completions` model does it: `echo` + `logprobs` over context+continuation,
summing the continuation's token_logprobs. The reference is transformers' own forward on the same token ids."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.e2e.requests import MODEL

pytestmark = pytest.mark.slow

PAIRS = [  # (context, continuation): likely and unlikely continuations, so both greedy verdicts occur
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a banana"),
    ("def add(a, b):\n    return", " a + b"),
    ("Question: What colour is the sky?\nAnswer:", " green"),
]


@pytest.fixture()
def stack(shared_stack):
    return shared_stack


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def transformers_loglikelihood(smollm2, context_ids, continuation_ids) -> tuple[float, bool]:
    """lm-evaluation-harness's HF model: sum of the continuation's logprobs, and whether each is the argmax."""
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(smollm2.model(ids).logits[0].float(), dim=-1)
    positions = range(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
    chosen = [logprobs[p, t].item() for p, t in zip(positions, continuation_ids, strict=True)]
    greedy = all(logprobs[p].argmax().item() == t for p, t in zip(positions, continuation_ids, strict=True))
    return sum(chosen), greedy


def harness_parse(choice, context_len: int, generated: int) -> tuple[float, bool]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs: the continuation's slice of the echoed token_logprobs (it
    asks for max_tokens=1 and drops the generated token with [ctxlen:-1]), greedy when each token's logprob is
    the top one's."""
    end = len(choice.logprobs.token_logprobs) - generated
    token_logprobs = choice.logprobs.token_logprobs[context_len:end]
    top_logprobs = choice.logprobs.top_logprobs[context_len:end]
    greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs, strict=True))
    return sum(token_logprobs), greedy


@pytest.mark.parametrize("max_tokens", [0, 1])  # lm-eval sends 1 and slices the generated token off; 0 is exact
def test_loglikelihood_like_lm_eval_equals_transformers(client, smollm2, max_tokens):
    tokenizer = smollm2.tokenizer
    verdicts = set()
    for context, continuation in PAIRS:
        context_ids = tokenizer(context)["input_ids"]
        continuation_ids = tokenizer(continuation)["input_ids"]
        prompt = context_ids + continuation_ids
        completion = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1,
                                               max_tokens=max_tokens, temperature=0, seed=1234)
        choice = completion.choices[0]
        assert len(choice.logprobs.tokens) == len(prompt) + max_tokens
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert choice.text.startswith(tokenizer.decode(prompt, skip_special_tokens=True))
        assert completion.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.finish_reason == "length"
        served, served_greedy = harness_parse(choice, len(context_ids), max_tokens)
        expected, expected_greedy = transformers_loglikelihood(smollm2, context_ids, continuation_ids)
        assert served == pytest.approx(expected, abs=2e-3), (context, continuation)
        assert served_greedy == expected_greedy, (context, continuation)
        verdicts.add(expected_greedy)
    assert verdicts == {True, False}


def test_echo_without_logprobs_returns_the_prompt_text(client):
    prompt = "Once upon a time,  there"  # two spaces: echo returns the text as sent, not a re-decoding
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs is None and scored.usage.completion_tokens == 0
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    bare = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)  # vLLM allows it: empty text
    assert bare.choices[0].text == "" and bare.choices[0].finish_reason == "length"


def test_streaming_echo_with_logprobs_matches_the_whole_response(client):
    prompt = "The quick brown fox"
    whole = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=5, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=5,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    token_logprobs = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens
    assert token_logprobs == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert offsets == whole.choices[0].logprobs.text_offset


def test_vllm_prompt_logprobs_extension(stack, smollm2):
    tokenizer = smollm2.tokenizer
    prompt = "Paris is the capital of France."
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        reference = torch.log_softmax(smollm2.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    with httpx.Client(base_url=stack.base_url, timeout=120) as http:
        body = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                  "prompt_logprobs": 2}).json()
        scores = body["choices"][0]["prompt_logprobs"]
        assert scores[0] is None and len(scores) == len(ids)
        for j, (token_id, position) in enumerate(zip(ids[1:], scores[1:], strict=True)):
            entry = position[str(token_id)]
            assert entry["logprob"] == pytest.approx(reference[j, token_id].item(), abs=1e-3)
            assert entry["rank"] == int((reference[j] > reference[j, token_id]).sum()) + 1
            assert entry["decoded_token"] == tokenizer.decode([token_id])
            best = reference[j].topk(2).indices.tolist()
            assert set(position) == {str(token_id), *map(str, best)}
            assert position[str(best[0])]["rank"] == 1
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "prompt_logprobs": 0,
                                                       "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["prompt_logprobs"][0] is None and all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "stream": True,
                                                     "prompt_logprobs": 1})
        assert refused.status_code == 400 and "prompt_logprobs" in refused.json()["error"]["message"]
        plain = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
        assert plain["choices"][0]["prompt_logprobs"] is None
