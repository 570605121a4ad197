"""vLLM's sampling and output fields on both generation routes, against the scripted verifier and the byte
tokenizer: the token rules reach the verifier as its proto carries them (bad_words tokenized as vLLM does), and
the output options shape the text and the response as vLLM's server does (stop strings and stop tokens left out
or kept, special tokens, token ids back, logprob tokens as ids, stop_reason)."""

from __future__ import annotations

import json

import pytest

from tests.gateway.fakes import EOS, ids_of
from tests.gateway.test_http import MODEL

CHAT = [{"role": "user", "content": "hi"}]
REPLY = "Hello, wörld! 你好. The end."


async def complete(client, **body) -> dict:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
    assert r.status_code == 200, r.text
    return r.json()


async def test_token_rules_reach_the_verifier(client, verifier):
    await complete(client, max_tokens=5, min_tokens=3, allowed_token_ids=[72, 101], bad_words=["wörld", " The end"])
    sent = verifier.requests[-1].sampling
    assert sent.min_tokens == 3 and list(sent.allowed_token_ids) == [72, 101]
    # the byte tokenizer has no merges, so " wörld" is one token longer than "wörld": only the plain form is sent
    # (vLLM's rule adds the spaced form only where it is as long), and " The end" is sent without its space first
    assert [list(w.token_ids) for w in sent.bad_words] == [ids_of("wörld"), ids_of("The end")]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                        "min_tokens": 2, "allowed_token_ids": [1]})
    assert r.status_code == 200 and verifier.requests[-1].sampling.min_tokens == 2


@pytest.mark.parametrize(("body", "message"), [
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["ok", "x" * 40]}, "bad_words[1] is 41 tokens; at most 32"),  # a byte a token, and a space
    ({"skip_special_tokens": "sometimes"}, "skip_special_tokens"),
])
async def test_bad_values_are_400s(client, body, message):
    for route, extra in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = await client.post(route, json={"model": MODEL, **extra, **body})
        assert r.status_code == 400 and message in r.text, (route, r.text)


async def test_stop_token_text_is_left_out_unless_asked(client, verifier):
    """vLLM leaves the stop token's text out of the output (it is in token_ids) unless include_stop_str_in_output;
    stop_reason names it. An end-of-sequence stop has stop_reason null."""
    comma = ord(",")
    body = await complete(client, max_tokens=20, stop_token_ids=[comma], return_token_ids=True)
    choice = body["choices"][0]
    assert choice["text"] == "Hello" and choice["finish_reason"] == "stop" and choice["stop_reason"] == comma
    assert choice["token_ids"] == ids_of("Hello,") and choice["prompt_token_ids"] == ids_of("Hi")
    body = await complete(client, max_tokens=20, stop_token_ids=[comma], include_stop_str_in_output=True)
    assert body["choices"][0]["text"] == "Hello,"
    body = await complete(client, max_tokens=100)
    assert body["choices"][0]["text"] == REPLY and body["choices"][0]["stop_reason"] is None


async def test_stop_strings_kept_and_min_tokens(client, verifier):
    verifier.tokens_per_step = 1  # vLLM looks for stop strings in each step's new text: one token a step here
    body = await complete(client, max_tokens=100, stop=["wö"], include_stop_str_in_output=True)
    assert body["choices"][0]["text"] == "Hello, wö" and body["choices"][0]["stop_reason"] == "wö"
    body = await complete(client, max_tokens=100, stop=["l"])
    assert body["choices"][0]["text"] == "He" and body["choices"][0]["stop_reason"] == "l"
    # no stop string is looked for until more than min_tokens tokens are out (vLLM's rule): the first "l"s pass
    body = await complete(client, max_tokens=100, stop=["l"], min_tokens=5)
    assert body["choices"][0]["text"] == "Hello, wör", body


async def test_skip_special_tokens(client, verifier):
    """The scripted reply ends with EOS (<|endoftext|>, a special token): its text shows only when it is kept
    (include_stop_str_in_output) and special tokens are text (skip_special_tokens false)."""
    verifier.reply = "ab"
    assert (await complete(client, max_tokens=10))["choices"][0]["text"] == "ab"
    kept = await complete(client, max_tokens=10, include_stop_str_in_output=True, skip_special_tokens=False)
    assert kept["choices"][0]["text"] == "ab<|endoftext|>"
    skipped = await complete(client, max_tokens=10, include_stop_str_in_output=True)
    assert skipped["choices"][0]["text"] == "ab"
    assert skipped["choices"][0]["finish_reason"] == "stop" and skipped["choices"][0]["stop_reason"] is None
    # a fast tokenizer joins special tokens as its decoder does whatever this says (as vLLM's fast path)
    spaced = await complete(client, max_tokens=10, include_stop_str_in_output=True, skip_special_tokens=False,
                            spaces_between_special_tokens=False)
    assert spaced["choices"][0]["text"] == "ab<|endoftext|>"


async def test_return_token_ids_in_streams_and_chat(client, verifier):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 6,
                                                        "return_token_ids": True})
    body = r.json()
    assert body["choices"][0]["token_ids"] == ids_of(REPLY)[:6]
    assert body["prompt_token_ids"] == list(verifier.requests[-1].prompt_token_ids)
    plain = (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                             "max_tokens": 6})).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

    for route, extra in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        async with client.stream("POST", route, json={"model": MODEL, **extra, "max_tokens": 7, "stream": True,
                                                      "return_token_ids": True}) as r:
            chunks = [json.loads(line[6:]) async for line in r.aiter_lines()
                      if line.startswith("data: {")]
        prompt = list(verifier.requests[-1].prompt_token_ids)
        if route == "/v1/completions":
            firsts = [c["choices"][0].get("prompt_token_ids") for c in chunks]
        else:
            firsts = [c.get("prompt_token_ids") for c in chunks]
        assert firsts[0] == prompt and all(f is None for f in firsts[1:]), (route, firsts)
        streamed = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
        assert streamed == ids_of(REPLY)[:7], route


async def test_return_tokens_as_token_ids(client):
    body = await complete(client, max_tokens=3, logprobs=1, return_tokens_as_token_ids=True)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids_of("Hel")]
    assert list(logprobs["top_logprobs"][0]) == ["token_id:72"]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                        "logprobs": True, "top_logprobs": 1,
                                                        "return_tokens_as_token_ids": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["token_id:72", "token_id:101"]
    assert content[0]["top_logprobs"][0]["token"] == "token_id:72"
    assert EOS == 256  # the fake's EOS id, which the stop-token tests above rely on


async def test_request_id_names_the_response(client, verifier):
    body = await complete(client, max_tokens=2, request_id="trace-42")
    assert body["id"] == "cmpl-trace-42"
    again = await complete(client, max_tokens=2, request_id="trace-42")  # the same id twice is not a conflict
    assert again["id"] == "cmpl-trace-42"
    assert verifier.requests[-1].request_id != verifier.requests[-2].request_id
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                        "request_id": "abc"})
    assert r.json()["id"] == "chatcmpl-abc"


@pytest.mark.parametrize(("field", "off", "on"), [
    ("use_beam_search", False, True),
    ("length_penalty", 1.0, 0.5),
    ("include_reasoning", True, False),
    ("priority", 0, 5),
    ("cache_salt", "", "tenant-a"),
    ("logits_processors", [], ["my.module:Processor"]),
    ("mm_processor_kwargs", {}, {"fps": 2}),
    ("guided_whitespace_pattern", None, "[ ]?"),
    ("kv_transfer_params", {}, {"do_remote_prefill": True}),
])
async def test_vllm_fields_without_an_effect_here_are_accepted_off_and_refused_on(client, field, off, on):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, field: off})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, field: on})
    assert r.status_code == 400 and f"{field}: " in r.json()["error"]["message"], r.text


async def test_chat_echo_false_is_accepted_and_true_refused(client):
    for echo, status in ((False, 200), (True, 400)):
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                            "echo": echo})
        assert r.status_code == status, r.text
