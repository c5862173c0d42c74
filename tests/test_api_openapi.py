"""The HTTP API's OpenAPI schema and its /docs page: the request and response models it declares
(with an API key too), and real responses and stream chunks that match those models.

The schema itself is fuzzed in test_api_schema.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from kvmesh.cluster.response_models import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ModelList,
)
from tests.api_helpers import CHAT, COMPLETIONS, chat, complete, sse_events
from tests.openai_helpers import MODEL, Spy, call, serve


def test_openapi_declares_the_models_and_docs_serve_it(server: tuple[int, Spy]) -> None:
    port = server[0]
    status, page = call(port, "GET", "/docs")
    assert status == 200 and "swagger" in page.lower() and "/openapi.json" in page
    status, schema = call(port, "GET", "/openapi.json")
    assert status == 200
    components = schema["components"]["schemas"]
    for path, request, response in (
        (CHAT, "ChatCompletionRequest", "ChatCompletionResponse"),
        (COMPLETIONS, "CompletionRequest", "CompletionResponse"),
    ):
        op = schema["paths"][path]["post"]
        assert op["requestBody"]["required"] is True
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request}"}
        fields = set(components[request]["properties"])
        assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"} <= fields
        responses = op["responses"]
        assert {"200", "400", "404", "413", "415", "500"} <= set(responses)
        assert "422" not in responses
        ok = responses["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert "text/event-stream" in ok
        assert set(components[response]["properties"]) >= {"usage", "kvmesh", "choices"}
    temperature = components["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert temperature == {"type": "number", "minimum": 0, "maximum": 2}
    models = schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    assert models["application/json"]["schema"] == {"$ref": "#/components/schemas/ModelList"}


def test_with_a_key_the_schema_says_so_and_stays_open(backend: LocalBackend) -> None:
    with serve(build_api(backend, model_name=MODEL, api_key="s3cret")) as port:
        assert call(port, "GET", "/docs")[0] == 200
        status, schema = call(port, "GET", "/openapi.json")
        assert status == 200
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert schema["paths"][CHAT]["post"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/health"]["get"]
        assert "401" in schema["paths"][CHAT]["post"]["responses"]


STREAMS: dict[str, tuple[str, dict[str, Any], type[BaseModel], type[BaseModel]]] = {
    "chat": (
        CHAT,
        chat(logprobs=True, top_logprobs=2)[1],
        ChatCompletionResponse,
        ChatCompletionChunk,
    ),
    "completions": (COMPLETIONS, complete(logprobs=2)[1], CompletionResponse, CompletionChunk),
    "completions echo": (
        COMPLETIONS,
        complete(logprobs=2, echo=True)[1],  # the prompt's first token has null logprobs
        CompletionResponse,
        CompletionChunk,
    ),
}


@pytest.mark.parametrize("case", STREAMS)
def test_responses_and_stream_chunks_match_the_models(server: tuple[int, Spy], case: str) -> None:
    """What schemathesis checks on random requests, on the paths it rarely reaches: logprobs
    and usage, whole and streamed."""
    path, body, full, chunk = STREAMS[case]
    body = {**body, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    status, got = call(server[0], "POST", path, body)
    assert status == 200, got
    assert full.model_validate(got).choices[0].logprobs is not None  # type: ignore[attr-defined]
    options = {"include_usage": True}
    status, events = sse_events(
        server[0], path, {**body, "stream": True, "stream_options": options}
    )
    assert status == 200 and len(events) >= 3
    for event in events:
        chunk.model_validate(event)
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["kvmesh"]
    ModelList.model_validate(call(server[0], "GET", "/v1/models")[1])
