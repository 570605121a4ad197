"""vLLM's --enable-log-requests: a line per request at INFO with what it asks (its prompt as text and as token ids,
and the sampling parameters the verifier gets), so an operator can see what a client sent that went wrong. Off by
default: prompts are users' data, and a log line per request costs the gateway's one event loop a decode.
--max-log-len cuts the prompt's text to that many characters and its ids to that many tokens, as in vLLM."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format

logger = logging.getLogger("specserve.gateway.requests")


def clipped(items: Sequence[Any] | str, limit: int | None) -> Any:
    """`items` cut to `limit` (None: whole)."""
    return items if limit is None else items[:limit]


def log_request(request_id: str, prompts: Sequence[Sequence[int]], sampling: Any, tokenizer: Any,
                max_log_len: int | None) -> None:
    """One line per prompt of the request `request_id` (a completion may send several): its text, its token ids
    and `sampling` (the proto SamplingParams of its first choice) on one line."""
    params = json_format.MessageToDict(sampling, always_print_fields_with_no_presence=True,
                                       preserving_proto_field_name=True)  # temperature 0.0 is said too
    params = {name: value for name, value in params.items() if value not in ([], {})}
    for index, ids in enumerate(prompts):
        text = tokenizer.decode(list(clipped(ids, max_log_len)))
        name = request_id if len(prompts) == 1 else f"{request_id} (prompt {index})"
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", name,
                    clipped(text, max_log_len), params, list(clipped(ids, max_log_len)))
