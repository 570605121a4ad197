"""The legacy completions `top_logprobs` entry as OpenAI and vLLM shape it: the chosen token first, then the
`logprobs` most likely ones (so `logprobs: 0` still names the chosen token), and an echoed token-id prompt whose
text holds every token the logprobs list, special ones included, so that text_offset indexes it."""

from __future__ import annotations

import httpx

from types import SimpleNamespace

from services.gateway.responses import LogprobFormatter
from tests.gateway.test_http import MODEL


def entry(token_id: int, logprob: float, *top: tuple[int, float]) -> SimpleNamespace:
    return SimpleNamespace(token_id=token_id, logprob=logprob,
                           top=[SimpleNamespace(token_id=t, logprob=lp) for t, lp in top])


def test_the_chosen_token_leads_each_entry_then_the_alternatives():
    formatter = LogprobFormatter(chr)
    out = formatter.completion([entry(72, -1.5, (101, -0.2), (72, -1.5)), entry(105, -0.1)], offset=3)
    assert out.tokens == ["H", "i"] and out.text_offset == [3, 4]
    assert [list(e.items()) for e in out.top_logprobs] == [[("H", -1.5), ("e", -0.2)], [("i", -0.1)]]
    echoed = formatter.echoed_prompt([72, 105], [entry(105, -2.0, (33, -0.3))], num_top=1)
    assert echoed.top_logprobs == [None, {"i": -2.0, "!": -0.3}]


async def test_logprobs_0_names_the_chosen_token(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "logprobs": 0})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{token: -0.5} for token in logprobs["tokens"]]


async def test_up_to_20_logprobs_as_vllm_allows(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 20})
    assert r.status_code == 200
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


async def test_the_limit_is_the_verifiers_max_logprobs(make_app, verifier):
    """The verifier says its --max-logprobs in Info; the gateway holds every request to it at admission."""
    verifier.max_logprobs = 40
    app = make_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 40,
                                                        "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        for body, param in (({"prompt": "Hi", "logprobs": 41}, "logprobs"),
                            ({"prompt": "Hi", "prompt_logprobs": 41}, "prompt_logprobs")):
            r = await client.post("/v1/completions", json={"model": MODEL, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param and "40" in r.text, r.text
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "logprobs": True, "top_logprobs": 41,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    await app.state.gateway.client.close()


async def test_an_echoed_token_id_prompt_keeps_its_special_tokens(client):
    eos = 256  # <|endoftext|> in the test tokenizer
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [eos, 72, eos], "max_tokens": 0,
                                                   "echo": True, "logprobs": 0})
    choice = r.json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text == "<|endoftext|>H<|endoftext|>"
    assert logprobs["tokens"] == ["<|endoftext|>", "H", "<|endoftext|>"]
    assert [text[o:o + len(t)] for o, t in zip(logprobs["text_offset"], logprobs["tokens"], strict=True)] == \
        logprobs["tokens"]


async def test_chat_logprob_bytes_are_each_tokens_own_and_join_to_the_reply(client, verifier):
    """A character split over tokens decodes to U+FFFD token by token: the entries' bytes are the tokens' own (one
    byte each from this byte-level vocabulary), so a client that joins them gets the reply's text (OpenAI's reason for
    the field), the top alternatives' likewise."""
    verifier.reply = "wörld 你好 🌾"
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 40, "logprobs": True, "top_logprobs": 1})
    choice = r.json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert entries[-1]["token"] == "<|endoftext|>"  # the end token is scored too (its text is not in the reply)
    entries = entries[:-1]
    joined = b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8")
    assert joined == choice["message"]["content"] == "wörld 你好 🌾"
    assert all(len(e["bytes"]) == 1 for e in entries) and "\ufffd" in {e["token"] for e in entries}
    assert all(top["bytes"] == e["bytes"] for e in entries for top in e["top_logprobs"])


def test_token_bytes_read_byte_level_and_byte_fallback_vocabularies():
    from services.gateway.token_bytes import TokenBytes
    from services.gateway.tokenizer import load_tokenizer

    smol = load_tokenizer("smollm2-135m-instruct")  # GPT-2's byte-level BPE: the emoji is 3 tokens
    ids = smol.encode("🌾 ok", add_special_tokens=False)
    token_bytes = TokenBytes(smol)
    assert b"".join(bytes(token_bytes(i)) for i in ids) == "🌾 ok".encode()
    assert token_bytes(smol.convert_tokens_to_ids("<|im_end|>")) == list(b"<|im_end|>")  # a special token: its text
    smol.add_tokens(["héllo"])  # not special: the byte-level decoder reads it too, as it reads the vocabulary
    token_bytes = TokenBytes(smol)
    for token_id in [*range(0, len(smol), 97), smol.convert_tokens_to_ids("héllo")]:  # what decoding it alone gives
        assert bytes(token_bytes(token_id)).decode("utf-8", "replace") == smol.decode([token_id]), token_id

    class SentencePieceLike:  # a byte-fallback piece names its byte; a word piece is its decoded text
        all_special_ids: list[int] = []
        pieces = {0: "<0xF0>", 1: "\u2581sea"}

        def convert_ids_to_tokens(self, token_id):
            return self.pieces[token_id]

        def decode(self, ids, skip_special_tokens=False):
            return {0: "\ufffd", 1: " sea"}[ids[0]]

    assert TokenBytes(SentencePieceLike())(0) == [0xF0] and TokenBytes(SentencePieceLike())(1) == list(b" sea")
