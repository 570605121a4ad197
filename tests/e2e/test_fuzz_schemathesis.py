"""Fuzzing the running stack (drafter, verifier with SmolLM2-135M, gateway as processes) with schemathesis,
from the gateway's own /openapi.json: valid and invalid requests on every /v1 operation, /tokenize, /detokenize and
/version must get no 5xx and responses that conform to the document, and afterwards the stack must be healthy with
nothing left running.

The run is bounded (~700 cases, about a minute on 2 cores): a fixed seed, a few dozen fuzzed cases per
operation plus schemathesis's coverage cases (boundary and invalid values of every field), one worker, and
tests/e2e/fuzz_hooks.py capping max_tokens (max_output_tokens), n and prompt sizes to small values the server accepts.
The document is fetched from the gateway; the only change made to it is that `model` names the served model
(anything else is a 404, and every positive case would end there).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.requests import MODEL
from tests.e2e.stack import REPO, Stack

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 30  # fuzzed cases per operation (the coverage phase adds its own)
CHECKS = "not_a_server_error,response_schema_conformance"


@pytest.fixture()
def stack(shared_stack):
    return shared_stack


REQUEST_SCHEMAS = ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "TokenizeCompletionRequest",
                   "TokenizeChatRequest", "DetokenizeRequest")


def fuzz_document(document: dict, model: str) -> dict:
    """The gateway's document with `model` pinned to the served name in every request body."""
    fuzzed = copy.deepcopy(document)
    schemas = fuzzed["components"]["schemas"]
    for name in REQUEST_SCHEMAS:
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [model]}
    return fuzzed


def run_schemathesis(base_url: str, document: dict, workdir: Path) -> dict:
    """`schemathesis run` on the document against the running gateway; returns its JSON report."""
    schema_file = workdir / "openapi.json"
    schema_file.write_text(json.dumps(document))
    report = workdir / "report.json"
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", str(schema_file), "--url", base_url,
        "--checks", CHECKS, "--mode", "all", "--phases", "examples,coverage,fuzzing",
        "--include-path-regex", "^/(v1/|tokenize$|detokenize$|version$)", "--max-examples", str(MAX_EXAMPLES),
        "--seed", "20261123",
        "--workers", "1", "--request-timeout", "120", "--no-shrink", "--suppress-health-check", "all",
        "--report", "json", "--report-json-path", str(report),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.fuzz_hooks", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, check=False, cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=420)
    assert report.exists(), result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(report.read_text())
    data["output"] = result.stdout[-6000:]
    return data


def wait_idle(base_url: str, timeout_s: float = 30.0) -> dict:
    """/health once the verifier has nothing running or waiting (cancelled requests go at its next step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(f"{base_url}/health", timeout=10).json()
        if health.get("num_running") == 0 and health.get("num_waiting") == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def test_fuzzing_finds_no_server_error_and_no_schema_violation(stack, tmp_path):
    document = httpx.get(f"{stack.base_url}/openapi.json", timeout=10).json()
    report = run_schemathesis(stack.base_url, fuzz_document(document, MODEL), tmp_path)
    cases = report["test_cases"]
    summary = json.dumps({"test_cases": cases, "valid_rates": report["valid_rates"]})
    print(f"schemathesis {report['schemathesis_version']}: {summary}")
    assert report["failures"] == [] and report["errors"] == [], report["output"]
    assert report["exit_code"] == 0, report["output"]
    assert cases["with_failures"] == 0 and cases["errored"] == 0, report["output"]
    # completions, chat, responses, models, models/{id}, tokenize, detokenize, version
    assert report["operations"]["tested"] == 8
    assert cases["generated"] >= 200, summary  # the run really ran
    # Valid requests reached the model or tokenizer, not only the 4xx paths. How many of the generated requests
    # are valid depends on the seed and on the schema (a new request field reshuffles every generated case): chat
    # had 10 accepted before speculative_config.draft_pipelining and 9 after, so the bound is what the check needs
    # (some requests got through), not what one schema happened to give.
    for operation in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize",
                      "POST /detokenize"):
        accepted = sum(phase["accepted"] for phase in report["valid_rates"][operation].values())
        assert accepted >= 5, summary

    health = wait_idle(stack.base_url)
    assert health["status"] == "ok", health
    assert health["num_running"] == 0 and health["num_waiting"] == 0, health
    ok = _post(stack, "/v1/completions",
               {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def _post(stack: Stack, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{stack.base_url}{path}", content=body, timeout=120,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=120)


def _logprobs(response: httpx.Response, stream: bool) -> list[float]:
    bodies = ([json.loads(line[6:]) for line in response.text.split("\n\n")
               if line.startswith("data: ") and line[6:] != "[DONE]"] if stream else [response.json()])
    values = []
    for body in bodies:
        for choice in body["choices"]:
            lp = choice.get("logprobs") or {}
            values += list(lp.get("token_logprobs", []))
            values += [v for top in lp.get("top_logprobs", []) for v in top.values()]
            values += [v for t in lp.get("content", []) for v in [t["logprob"]] + [x["logprob"]
                                                                               for x in t["top_logprobs"]]]
    return values


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_filtered_tokens_are_finite(stack, stream):
    """Tokens removed by top-p/top-k/min-p have logprob -inf; the response carries -9999.0 instead."""
    prompt = "Once upon a time"
    values = []
    for seed in range(4):
        r = _post(stack, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "logprobs": 5,
                                             "top_p": 0.05, "top_k": 2, "min_p": 0.5, "seed": seed,
                                             "stream": stream})
        assert r.status_code == 200, r.text
        values += _logprobs(r, stream)
        messages = [{"role": "user", "content": prompt}]
        r = _post(stack, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 6,
                                                  "logprobs": True, "top_logprobs": 5, "top_p": 0.05,
                                                  "seed": seed, "stream": stream})
        assert r.status_code == 200, r.text
        values += _logprobs(r, stream)
    assert values and all(v is not None and -9999.0 <= v <= 0.0 for v in values), values
    assert -9999.0 in values  # the top-5 alternatives include tokens the filters removed


def test_edge_values_on_the_real_model(stack):
    base = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6}
    greedy = _post(stack, "/v1/completions", {**base, "temperature": 0})
    assert greedy.status_code == 200
    for temperature in (1e-45, 1e-38, 9e-6):  # greedy, not NaN or empty
        r = _post(stack, "/v1/completions", {**base, "temperature": temperature, "logprobs": 1})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
        assert all(v > -9999.0 for v in _logprobs(r, False))
    assert _post(stack, "/v1/completions", {**base, "top_k": 2**32, "temperature": 0}).status_code == 200
    same = [_post(stack, "/v1/completions", {**base, "seed": seed, "n": 2, "max_tokens": 8}).json()["choices"]
            for seed in (-1, 2**64 - 1, 2**64 - 1)]
    assert same[0] == same[1] == same[2]  # -1 is 2**64 - 1 mod 2**64; choice 1 wraps to seed 0
    for body in (b'{"model": "smollm2-135m-instruct", "prompt": "a\\ud800"}',
                 b'{"model": "smollm2-135m-instruct", "prompt": "a", "n": 1' + b"1" * 5000 + b"}",
                 b'{"model": "smollm2-135m-instruct", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        r = _post(stack, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    assert wait_idle(stack.base_url)["num_running"] == 0
