"""vLLM's --generation-config: a model's generation_config.json sampling defaults reach the verifier for the requests
that leave those fields out, never over a request's own value; "vllm" keeps OpenAI's defaults; a value a request
could not send fails the start naming the file and the field."""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.generation_defaults import GenerationDefaults, read_generation_defaults

MODEL = "tiny-test"
QWEN_LIKE = {"bos_token_id": 1, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
             "repetition_penalty": 1.05, "max_new_tokens": 40}


def config_folder(tmp_path, **config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_sampling_fields_of_a_generation_config_are_read_and_nothing_else(tmp_path):
    defaults = read_generation_defaults(config_folder(tmp_path, **QWEN_LIKE), None)
    assert defaults.sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert defaults.max_tokens == 40 and defaults.default_max_tokens(25) == 25 and defaults.default_max_tokens(99) == 40
    assert read_generation_defaults("vllm", str(tmp_path)) == GenerationDefaults()
    assert read_generation_defaults("auto", None) == GenerationDefaults()  # the model not known yet


@pytest.mark.parametrize(("config", "says"), [({"temperature": 5}, "temperature 5 is outside"),
                                              ({"top_p": 0}, "top_p 0 is outside"),
                                              ({"top_k": "20"}, "top_k must be a number"),
                                              ({"max_new_tokens": 0}, "max_new_tokens must be a positive")])
def test_a_value_no_request_could_send_is_refused_naming_it(tmp_path, config, says):
    with pytest.raises(ValueError, match=says):
        read_generation_defaults(config_folder(tmp_path, **config), None)
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_generation_defaults(str(tmp_path / "nowhere"), None)


async def _chat(app, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json=body)
    await app.state.gateway.client.close()
    assert r.status_code == 200, r.text
    return r


async def test_the_models_defaults_reach_the_verifier_where_the_request_has_none(make_app, verifier, tmp_path):
    app = make_app(generation_config=config_folder(tmp_path, **QWEN_LIKE))
    await _chat(app)
    sampling = verifier.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == pytest.approx((0.7, 0.8, 20))
    assert sampling.repetition_penalty == pytest.approx(1.05) and sampling.max_tokens == 40
    app = make_app(generation_config=config_folder(tmp_path, **QWEN_LIKE))
    await _chat(app, temperature=0, top_p=1.0, max_tokens=5)  # the request's own values win, 0 and 1 included
    sampling = verifier.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == pytest.approx((0, 1, 20, 5))


async def test_vllm_keeps_openais_defaults(make_app, verifier):
    await _chat(make_app(generation_config="vllm"))
    sampling = verifier.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (1, 1, 0, 1)
