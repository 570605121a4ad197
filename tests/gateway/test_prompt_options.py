"""vLLM's prompt options on both generation routes, against the scripted verifier and the byte tokenizer:
`add_special_tokens` (a completion's text prompt gets the tokenizer's special tokens unless false; a chat's only
those its template writes unless true) and `truncate_prompt_tokens` (only the prompt's last k tokens reach the
verifier; -1: max_model_len of them; 0 is a 400)."""

from __future__ import annotations

import httpx
from tokenizers import processors

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tests.gateway.fakes import byte_tokenizer, ids_of
from tests.gateway.test_http import MODEL

CHAT = [{"role": "user", "content": "hi"}]


async def test_truncate_prompt_tokens_keeps_the_last_tokens(client, verifier):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2,
                                                   "truncate_prompt_tokens": 5, "echo": True})
    assert r.status_code == 200, r.text
    assert list(verifier.requests[-1].prompt_token_ids) == ids_of("there")
    assert r.json()["choices"][0]["text"].startswith("there")  # the echo is the prompt as kept
    assert r.json()["usage"]["prompt_tokens"] == 5
    await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                    "truncate_prompt_tokens": 3})
    assert len(verifier.requests[-1].prompt_token_ids) == 3
    await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2,
                                               "truncate_prompt_tokens": 10})  # longer than the prompt: all kept
    assert list(verifier.requests[-1].prompt_token_ids) == [1, 2, 3]


async def test_truncate_to_max_model_len_and_bad_values(client, verifier):
    long_prompt = "x" * 300  # 300 tokens; the scripted verifier's max_model_len is 256
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 2,
                                                   "truncate_prompt_tokens": 200})
    assert r.status_code == 200 and len(verifier.requests[-1].prompt_token_ids) == 200
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 2,
                                                   "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # no room left
    for bad in (0, -2):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.text, r.text  # chat as well


async def test_add_special_tokens(scripted, verifier):
    """On a tokenizer of its own that puts <|endoftext|> before a text (the session's adds nothing, and other
    tests share it)."""
    tokenizer = byte_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 256)])
    app = create_app(GatewaySettings(verifier=scripted[1]), tokenizer=tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert list(verifier.requests[-1].prompt_token_ids) == [256, *ids_of("Hi")]
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                   "add_special_tokens": False})
        assert list(verifier.requests[-1].prompt_token_ids) == ids_of("Hi")
        await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1})
        plain = list(verifier.requests[-1].prompt_token_ids)
        await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                        "add_special_tokens": True})
        assert list(verifier.requests[-1].prompt_token_ids) == [256, *plain]
    await app.state.gateway.client.close()


async def test_chat_template_kwargs_reach_the_template(scripted, verifier):
    """vLLM's chat_template_kwargs (e.g. Qwen3's enable_thinking) are variables of the model's own template, on
    /v1/chat/completions and /tokenize alike; names the server renders with are refused, as is a template sent in
    the request."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking %}<think>{% endif %}")
    app = create_app(GatewaySettings(verifier=scripted[1]), tokenizer=tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1})
        assert list(verifier.requests[-1].prompt_token_ids) == ids_of("hi")
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                            "chat_template_kwargs": {"enable_thinking": True}})
        assert r.status_code == 200 and list(verifier.requests[-1].prompt_token_ids) == ids_of("hi<think>")
        counted = await client.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"enable_thinking": 1}})
        assert counted.json()["tokens"] == ids_of("hi<think>")
        for body in ({"chat_template_kwargs": {"add_generation_prompt": False}},
                     {"chat_template_kwargs": {"messages": []}},
                     {"chat_template": "{{ messages }}"}):
            r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body})
            assert r.status_code == 400 and "chat_template" in r.json()["error"]["message"], r.text
    await app.state.gateway.client.close()
