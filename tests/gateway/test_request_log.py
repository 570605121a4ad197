"""vLLM's --enable-log-requests and --max-log-len: a line per request with its prompt and sampling parameters, off
by default."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest

from services import launcher
from services.gateway.main import parse_args

LOGGER = "specserve.gateway.requests"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(list(argv))


async def post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        response = await client.post(path, json=body)
    await app.state.gateway.client.close()
    assert response.status_code == 200, response.text
    return response


async def test_each_request_is_logged_with_its_prompt_and_parameters_cut_to_max_log_len(make_app, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    app = make_app(enable_log_requests=True, max_log_len=5)
    response = await post(app, "/v1/completions", {"model": "tiny-test", "prompt": "Hello world", "max_tokens": 3,
                                                     "temperature": 0.5, "seed": 7, "request_id": "mine"})
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert response.json()["id"] == "cmpl-mine"
    assert line.startswith("Received request cmpl-mine: prompt: 'Hello', params: {'max_tokens': 3, 'temperature': 0.5")
    assert line.endswith("prompt_token_ids: [72, 101, 108, 108, 111]")  # the byte tokenizer's ids, five of them

    caplog.clear()
    await post(make_app(enable_log_requests=True), "/v1/completions",
               {"model": "tiny-test", "prompt": ["Hi", "Yo"], "max_tokens": 2})
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [line.split(": prompt:")[0].split(" ", 3)[3] for line in lines] == ["(prompt 0)", "(prompt 1)"]
    assert "prompt: 'Hi'" in lines[0] and "prompt: 'Yo'" in lines[1]
    assert lines[0].endswith("prompt_token_ids: [72, 105]")


async def test_nothing_is_logged_by_default(make_app, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    await post(make_app(), "/v1/chat/completions",
               {"model": "tiny-test", "messages": [{"role": "user", "content": "secret"}], "max_tokens": 2})
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_serve_passes_the_flags_to_the_gateway_and_refuses_them_together():
    *_, gateway = launcher.plan(parse("--enable-log-requests", "--max-log-len", "100"))
    assert "--enable-log-requests" in gateway.argv
    assert gateway.argv[gateway.argv.index("--max-log-len") + 1] == "100"
    with pytest.raises(ValueError, match="say the opposite"):
        launcher.plan(parse("--enable-log-requests", "--disable-log-requests"))
    with pytest.raises(SystemExit):
        parse_args(["--enable-log-requests", "--disable-log-requests"])
    settings = parse_args(["--enable-log-requests", "--max-log-len", "9"])
    assert settings.enable_log_requests and settings.max_log_len == 9
