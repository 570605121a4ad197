"""Request bodies read by hand: a size limit, the body's Content-Encoding undone, strict UTF-8, JSON as JSON
defines it, then the pydantic model.

FastAPI's own body parsing would answer 422 in its own shape and let through what Python's json module accepts
but JSON does not (NaN, lone surrogate escapes), or fail with a 500 on what it cannot take (an integer of over
4300 digits, nesting deeper than the recursion limit). Here every such body is an OpenAI-shaped 400 or 413.

A body a client compressed (`Content-Encoding: gzip` or `deflate`, as HTTP clients and proxies configured to save
upload bytes send it) is inflated, under the same size limit, so a small compressed body cannot expand without
bound; any other coding is a 415 that names the ones taken. Read as it came, a gzip body was refused as "not valid
UTF-8", which sent its sender looking in the wrong place.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import deque
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from services.gateway.errors import ApiError

# A body's Content-Encoding -> zlib's window bits to inflate it with (gzip's header and trailer, zlib's)
_INFLATE_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}

# A JSON escape of a UTF-16 surrogate; only bodies that contain one are searched for an unpaired one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, read once: a route that hands its request on (/invocations) reads it again from here."""
    if hasattr(request.state, "json_body"):
        return request.state.json_body
    request.state.json_body = await _read_json(request, limit)
    return request.state.json_body


async def _read_json(request: Request, limit: int) -> Any:
    codings = _content_codings(request.headers.get("content-encoding"))
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    for coding in reversed(codings):  # listed in the order they were applied
        body = _inflated(body, coding, limit)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                       code="invalid_encoding") from exc
    data = _decode_json(text)
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(data)
    return data


def _content_codings(header: str | None) -> list[str]:
    """The codings a Content-Encoding header lists, identity left out; one this server cannot undo is a 415, before
    the body is read."""
    codings = [coding.strip().lower() for coding in (header or "").split(",")]
    codings = [coding for coding in codings if coding and coding != "identity"]
    for coding in codings:
        if coding not in _INFLATE_WBITS:
            raise ApiError(415, f"Content-Encoding {coding!r} is not supported: send the body uncompressed, gzip or "
                                "deflate", code="unsupported_content_encoding")
    return codings


def _inflated(body: bytes, coding: str, limit: int) -> bytes:
    """`body` inflated from `coding`, at most `limit` bytes of it (a 413 beyond); a body that is not whole data of
    that coding is a 400."""
    inflater = zlib.decompressobj(_INFLATE_WBITS[coding])
    try:
        inflated = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ApiError(400, f"request body is not valid {coding} data ({exc})", code="invalid_encoding") from exc
    if len(inflated) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes once inflated", code="request_too_large")
    if not inflater.eof or inflater.unused_data:
        raise ApiError(400, f"request body is not whole {coding} data (truncated, or followed by other bytes)",
                       code="invalid_encoding")
    return inflated


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _decode_json(text: str) -> Any:
    """json.loads, with everything it accepts that JSON does not (NaN, Infinity) or cannot take (an integer
    beyond Python's 4300-digit limit, nesting deeper than the recursion limit) refused as a 400."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
                       code="invalid_json") from exc
    except RecursionError as exc:
        raise ApiError(400, "request body is not valid JSON: it is nested too deeply",
                       code="invalid_json") from exc
    except ValueError as exc:  # an over-long integer, NaN or Infinity
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate_path(data: Any) -> list[str] | None:
    """Path of the shallowest string (or key) holding an unpaired surrogate, which json.loads lets through
    from a `\\ud800` escape but which is not text: the tokenizer and every UTF-8 encoder fail on it.
    Iterative, so a deeply nested body cannot exhaust the stack."""
    pending: deque[tuple[list[str], Any]] = deque([([], data)])
    while pending:
        path, value = pending.popleft()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_text(key):
                    return [*path, key.encode("utf-8", "backslashreplace").decode()]
                pending.append(([*path, key], item))
        elif isinstance(value, list):
            pending.extend(([*path, str(i)], item) for i, item in enumerate(value)
                           if isinstance(item, (str, dict, list)))
    return None


def _refuse_lone_surrogates(data: Any) -> None:
    path = _lone_surrogate_path(data)
    if path is not None:
        where = ".".join(path) or "request body"
        raise ApiError(400, f"{where}: contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
                            "which is not valid Unicode text", param=path[0] if path else None,
                       code="invalid_encoding")


def parse_body(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_value")
    return model.model_validate(data)  # ValidationError -> 400 by the installed handler
