"""What the end-to-end tests send: the served model's name and a code-edit prompt whose answer copies much of
the prompt (so n-gram speculation accepts tokens)."""

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from services.soak.traffic import CODE, EDIT, MODEL  # one copy: the soak's traffic sends the same edit

__all__ = ["CODE", "EDIT", "MODEL", "NO_SPEC", "at_once", "in_background", "wait_until_speculation_accepts"]

NO_SPEC = {"speculative_config": {"method": "none"}}


def at_once(*calls: Callable[[], Any]) -> list[Any]:
    """The results of independent requests sent together, in order. The verifier verifies them in shared steps,
    as it does for users, so a test pays each step's fixed cost (~0.1 s of a 2-core test run) once for all of
    them instead of once per request; greedy output must not depend on what else is in the batch."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def in_background(call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
    """One request started on a thread of its own, beside a stream the test drives step by step (so it shares
    that stream's steps); the future holds its result."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(call, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def wait_until_speculation_accepts(client, messages, attempts: int = 10) -> int:
    """Accepted draft tokens of the first of a few greedy chat requests that accepts any (a drafter that came
    back is used again once the verifier's link to it is up); 0 if none did."""
    for _ in range(attempts):
        again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        accepted = again.model_extra["speculative_decoding"]["num_accepted_tokens"]
        if accepted > 0:
            return accepted
        time.sleep(0.5)
    return 0
