"""vLLM's /tokenize, /detokenize and /version against the scripted verifier and the byte tokenizer (each byte its
own id, <|endoftext|> = 256): a prompt or chat messages in, the ids that a generation request would send, their
count and max_model_len out; ids in, text out; bad input a 400, another model a 404."""

from __future__ import annotations

from tests.gateway.fakes import ids_of
from tests.gateway.test_http import MODEL


async def test_a_prompt_is_tokenized_as_a_completion_request_would_be(client, verifier):
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hi!", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == ids_of("Hi!") and body["count"] == 3
    assert body["token_strs"] == ["H", "i", "!"] and body["max_model_len"] > 0
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi!", "max_tokens": 1})
    assert list(verifier.requests[-1].prompt_token_ids) == body["tokens"]
    plain = (await client.post("/tokenize", json={"prompt": "Hi!"})).json()  # model is optional, as in vLLM
    assert plain["tokens"] == body["tokens"] and plain["token_strs"] is None


async def test_chat_messages_are_tokenized_through_the_chat_template(client, verifier):
    messages = [{"role": "user", "content": "hi"}]
    body = (await client.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
    await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert body["tokens"] == list(verifier.requests[-1].prompt_token_ids) and body["count"] == len(body["tokens"])
    bare = (await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
    assert bare["count"] < body["count"]


async def test_detokenize_returns_the_text_of_the_ids(client):
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": [*ids_of("Hi"), 256]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hi<|endoftext|>"}


async def test_bad_input_is_a_400_and_another_model_a_404(client):
    for path, body, param in [("/tokenize", {"prompt": "x", "messages": []}, "messages"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [72, True]}, "tokens: expected numbers")]:
        r = await client.post(path, json=body)
        assert r.status_code == 400 and param in (r.json()["error"]["param"] or r.json()["error"]["message"]), r.text
    r = await client.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_version_and_the_documented_routes(client):
    r = await client.get("/version")
    assert r.status_code == 200 and r.json()["version"]
    document = (await client.get("/openapi.json")).json()
    assert {"/tokenize", "/detokenize", "/version"} <= set(document["paths"])
    assert {"TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"} <= set(
        document["components"]["schemas"])
