"""The OpenAPI document (`/openapi.json`) of the routes that read their bodies by hand.

The completion routes parse their bodies themselves (size limit, strict UTF-8, JSON, then pydantic) so every
failure is an OpenAI-shaped 400/413, never FastAPI's 422; that leaves FastAPI nothing to describe. So the
request models' JSON schemas are added to the document's components here, and each route names its body and its
responses (the JSON body on 200, the same status as an SSE stream when `stream` is true, the error shape on
every error status), so clients and fuzzers can use the document as it stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.gateway.schemas import ErrorResponse

_REF = "#/components/schemas/{model}"
ERROR_STATUSES = (400, 401, 404, 413, 500, 503)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


def sse_event_schema(chunk_model: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream, as OpenAPI before 3.2 has `schema` describe each event: its `data` is
    a chunk (or, after the headers, an error) as JSON, and the last one is `[DONE]`."""
    payload = {"anyOf": [{"$ref": _REF.format(model=chunk_model.__name__)},
                         {"$ref": _REF.format(model=ErrorResponse.__name__)}]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]}},
        "description": f"server-sent events, each `data: <{chunk_model.__name__} JSON>` (an error object if "
                       "the generation fails after the headers), ending with `data: [DONE]`",
    }


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` for a hand-parsed JSON body: one of `models` (register them with install_openapi)."""
    refs = [{"$ref": _REF.format(model=model.__name__)} for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def generation_docs(request_model: type[BaseModel], response_model: type[BaseModel],
                    chunk_model: type[BaseModel]) -> dict[str, Any]:
    """Keyword arguments for a completion route's decorator: its request body and its responses."""
    stream = {"schema": sse_event_schema(chunk_model)}
    return {
        "openapi_extra": request_body(request_model),
        "responses": {200: {"model": response_model, "description": "The completion; an SSE stream of "
                            f"{chunk_model.__name__} objects when `stream` is true",
                            "content": {"text/event-stream": stream}},
                      **error_responses(*ERROR_STATUSES)},
    }


def install_openapi(app: FastAPI, request_models: Sequence[type[BaseModel]],
                    extra_models: Sequence[type[BaseModel]] = ()) -> Callable[[], dict[str, Any]]:
    """Make `app.openapi()` FastAPI's document plus the schemas of the hand-parsed request bodies (validation
    mode: what a client may send) and of `extra_models` (e.g. SSE chunks, which no route returns as JSON)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = [(m, "validation") for m in request_models] + [(m, "serialization") for m in extra_models]
            _, definitions = models_json_schema(models, ref_template=_REF)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in definitions.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return openapi
