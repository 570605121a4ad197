"""Schemathesis hooks for tests/e2e/test_fuzz_schemathesis.py (loaded by the CLI through SCHEMATHESIS_HOOKS).

They keep each generated request cheap: a generation limit the server would accept (max_tokens, n) is
lowered to a small one that it accepts too, a request without max_tokens gets one (absent or null, it means the
rest of the context window), and prompts and message lists are cut short. Values the server must refuse
(wrong types, out of range) are left alone, so negative cases stay negative, except where the cut drops the
invalid part (a bad third message): such a case becomes a valid one, which the checks run here (no 5xx,
responses as documented) cover just the same.
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

MAX_TOKENS = 8
# The Responses API's bodies are mostly valid as generated (its fields are few and optional), so nearly all of its
# cases generate: at 8 tokens they took 86 of the fuzz run's 121 s. What is fuzzed there is the route's own shapes
# in and out, which 2 tokens show whole (every event of a stream); the generation is the chat pipeline's, fuzzed
# at 8 tokens on /v1/chat/completions.
MAX_OUTPUT_TOKENS = 2
MAX_N = 2
MAX_BATCH = 2  # prompts in a batch, messages in a chat
MAX_TEXT = 256  # characters of a prompt or message


def _valid_int(value: Any, low: int, high: int) -> bool:
    """Whether the server takes `value` as an integer in [low, high] (pydantic's lax mode takes 2887.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def cap_body(body: Any, path: str = "/v1/completions") -> Any:
    """path: the operation's; /v1 bodies generate (not /tokenize's, which have no max_tokens to add), and the
    Responses API's limit is max_output_tokens."""
    if not isinstance(body, dict):
        return body
    limits = () if not path.startswith("/v1/") else (
        ("max_output_tokens",) if path == "/v1/responses" else ("max_tokens", "max_completion_tokens"))
    cap = MAX_OUTPUT_TOKENS if path == "/v1/responses" else MAX_TOKENS
    for key in limits:
        if _valid_int(body.get(key), cap + 1, 2**31 - 1):
            body[key] = cap
    if limits and all(body.get(key) is None for key in limits):
        body[limits[0]] = cap  # absent or null means the rest of the context window
    if _valid_int(body.get("n"), MAX_N + 1, 16):
        body["n"] = MAX_N
    for key in ("prompt", "messages", "input"):
        value = body.get(key)
        if isinstance(value, str):
            body[key] = value[:MAX_TEXT]
        elif isinstance(value, list) and value and isinstance(value[0], (str, list, dict)):
            body[key] = value[:MAX_BATCH]
        elif isinstance(value, list):
            body[key] = value[:MAX_TEXT]  # one prompt of token ids
    return body


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    case.body = cap_body(case.body, case.path)


@schemathesis.hook
def after_call(context: Any, case: Any, response: Any) -> None:
    """Log each call's size and time, so a slow run shows which cases cost (to $SPECSERVE_FUZZ_LOG)."""
    log = os.environ.get("SPECSERVE_FUZZ_LOG")
    if log and isinstance(case.body, dict):
        with open(log, "a") as out:
            out.write(json.dumps({"path": case.path, "status": response.status_code,
                                  "seconds": round(response.elapsed, 3),
                                  "max_tokens": case.body.get("max_tokens"), "n": case.body.get("n"),
                                  "stream": case.body.get("stream")}) + "\n")
