"""vLLM's --served-model-name: the model served under several names, any of which a request may give (the OpenAI
SDK's `model`), responses and metrics giving the first; /v1/models lists each; any other name is a 404 that names
them. Also from the environment (comma-separated), as every gateway setting."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.gateway.settings import GatewaySettings

NAMES = ["coder", "org/coder-v2"]


def test_any_served_name_is_accepted_and_responses_give_the_first(served):
    client = openai.OpenAI(base_url=served(served_model_name=NAMES) + "/v1", api_key="unused")
    for name in NAMES:
        completion = client.completions.create(model=name, prompt="Hi", max_tokens=4)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert completion.model == chat.model == NAMES[0]
    assert [model.id for model in client.models.list()] == NAMES
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="tiny-test", prompt="Hi", max_tokens=4)  # the verifier's id is not served
    assert error.value.body["code"] == "model_not_found"
    assert all(f"`{name}`" in error.value.body["message"] for name in NAMES)


async def test_metrics_are_labelled_with_the_first_name(make_app):
    app = make_app(served_model_name=NAMES)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        r = await client.post("/v1/completions", json={"model": NAMES[1], "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        text = (await client.get("/metrics")).text
        assert f'vllm:generation_tokens_total{{model_name="{NAMES[0]}"}}' in text
        assert f'model_name="{NAMES[1]}"' not in text
    await app.state.gateway.client.close()


def test_names_come_as_flags_or_comma_separated_from_the_environment(monkeypatch):
    from services.gateway.main import parse_args

    assert parse_args(["--served-model-name", *NAMES]).served_model_name == NAMES
    assert parse_args(["--served-model-name", "one"]).served_model_name == ["one"]
    monkeypatch.setenv("SPECSERVE_GATEWAY_SERVED_MODEL_NAME", " coder, org/coder-v2")
    assert GatewaySettings().served_model_name == NAMES
    monkeypatch.setenv("SPECSERVE_GATEWAY_SERVED_MODEL_NAME", "coder,,x")
    with pytest.raises(ValueError, match="non-empty"):
        GatewaySettings()
