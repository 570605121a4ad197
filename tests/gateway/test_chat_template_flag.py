"""vLLM's --chat-template: a template given at start-up (a file, or the template itself) renders every chat request in
place of the model's own, for generation and /tokenize alike; a path that is no file and no template, or a template
Jinja cannot parse, fails the start with a clear message."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.settings import GatewaySettings
from tests.gateway.fakes import ids_of
from tests.gateway.test_http import MODEL

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("given", ["file", "text"])
async def test_the_template_given_renders_every_chat(make_app, verifier, tokenizer, tmp_path, given):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    app = make_app(chat_template=str(path) if given == "file" else TEMPLATE)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert list(verifier.requests[-1].prompt_token_ids) == ids_of("<system>be brief<user>hi>")
        counted = (await client.post("/tokenize", json={"messages": MESSAGES})).json()
        assert counted["tokens"] == ids_of("<system>be brief<user>hi>")
    await app.state.gateway.client.close()
    assert tokenizer.chat_template != TEMPLATE  # the shared tokenizer keeps the model's own


@pytest.mark.parametrize(("value", "message"), [
    ("./no/such/template.jinja", "neither a file nor a Jinja template"),
    ("{% for m in messages %}{{ m.content }}", "not a valid Jinja template"),
])
def test_a_bad_template_fails_the_start_and_says_why(value, message):
    with pytest.raises(ValueError, match=message):
        GatewaySettings(chat_template=value)
