"""/openapi.json describes the bodies the hand-parsing routes really take and return, so clients and fuzzers
(tests/e2e/test_fuzz_schemathesis.py) can use it."""

from __future__ import annotations

from services.common.sampling_rules import SEED_MAX, SEED_MIN
from services.gateway import schemas as s


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


async def test_the_document_has_the_real_bodies(client):
    doc = (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    for path, request, response in [("/v1/completions", "CompletionRequest", "CompletionResponse"),
                                    ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")]:
        operation = doc["paths"][path]["post"]
        body = operation["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == _ref(request)
        ok = operation["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == _ref(response)
        data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]  # one event, as 3.1 reads it
        assert {"const": "[DONE]"} in data
        chunk = response.replace("Response", "Chunk")
        assert {"type": "string", "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}} in data
        for status in ("400", "401", "404", "413", "500", "503"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == _ref("ErrorResponse")
        assert "422" not in operation["responses"]  # the routes answer bad bodies with 400, not FastAPI's 422
    assert set(schemas["CompletionRequest"]["required"]) == {"model", "prompt"}
    assert schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0] == {
        "type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}
    assert set(schemas["ChatCompletionRequest"]["required"]) == {"model", "messages"}
    assert {"ChatMessage", "RequestSpeculativeConfig", "CompletionChunk", "ChatCompletionChunk"} <= set(schemas)
    models = doc["paths"]["/v1/models"]["get"]["responses"]
    assert models["200"]["content"]["application/json"]["schema"] == _ref("ModelList")
    assert doc["paths"]["/health"]["get"]["responses"]["503"]["content"]["application/json"]["schema"] == _ref(
        "Health")


async def test_the_error_schema_matches_what_is_sent(client):
    r = await client.post("/v1/completions", json={"model": "tiny-test"})
    assert r.status_code == 400
    s.ErrorResponse.model_validate(r.json())
    assert set(r.json()["error"]) == set(s.ErrorDetail.model_fields)


async def test_every_operation_has_its_own_id(client):
    """Code generators name a client's methods by operationId; /ping served GET and POST as one route, and the
    document gave both one id."""
    doc = (await client.get("/openapi.json")).json()
    ids = [operation["operationId"] for methods in doc["paths"].values() for operation in methods.values()]
    assert len(ids) == len(set(ids)) and {"ping_get", "ping_post"} <= set(ids)
