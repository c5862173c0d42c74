"""The OpenAPI schema of the HTTP API: what FastAPI generates from the routes, plus the
request models (``protocol.py``) and response models (``response_models.py``) that the routes
parse and build themselves, the error answers each route may give, and the bearer scheme
when an API key is set."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from kvmesh.cluster.http_errors import OVERLOADED_STATUS
from kvmesh.cluster.protocol import REQUEST_MODELS
from kvmesh.cluster.response_models import RESPONSE_MODELS

_REF = "#/components/schemas/{model}"
# Outside /v1, the paths that need the API key when one is set.
KEYED_PATHS = ("/metrics", "/tokenize", "/detokenize")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def request_body(model: type[Any]) -> dict[str, Any]:
    """openapi_extra for a route that parses its own body (off the event loop)."""
    content = {"application/json": {"schema": _ref(model.__name__)}}
    return {"requestBody": {"required": True, "content": content}}


def json_response(name: str, description: str) -> dict[int | str, Any]:
    return {
        200: {"description": description, "content": {"application/json": {"schema": _ref(name)}}}
    }


def generation_responses(full: str, chunk: str) -> dict[int | str, Any]:
    # One server-sent event, as schemathesis and OpenAPI < 3.2 tools read a stream's schema:
    # its data is a chunk (or an error, after the first event) as JSON, or [DONE] at the end.
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]},
                    },
                ]
            }
        },
        "description": f"With stream: server-sent events `data: <{chunk}>`, then `data: [DONE]`;"
        " an error after the first event comes as `data: <ErrorResponse>`.",
    }
    content = {
        "application/json": {"schema": _ref(full)},
        "text/event-stream": {"schema": event},
    }
    return {200: {"description": f"{full}, or a stream of {chunk}s.", "content": content}}


_ERRORS = {
    400: "Bad input; `param` names the field.",
    401: "Missing or wrong API key.",
    404: "Unknown model.",
    413: "Request body over max_request_bytes.",
    415: "Request body in a content coding (e.g. gzip): send it uncompressed.",
    OVERLOADED_STATUS: "Overloaded: this server admits no more requests now (type "
    "`overloaded_error`, code `overloaded`); retry after the `Retry-After` header's seconds.",
    500: "Internal error; the detail is in the server's log.",
    503: "The request could not be finished now (no worker is available, or its worker was "
    "lost too often); the message names the cause.",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "required": True,
        "schema": {"type": "integer", "minimum": 1},
    }
}


def error_responses(*statuses: int) -> dict[int | str, Any]:
    content = {"application/json": {"schema": _ref("ErrorResponse")}}
    out: dict[int | str, Any] = {}
    for s in statuses:
        out[s] = {"description": _ERRORS[s], "content": content}
        if s == OVERLOADED_STATUS:
            out[s]["headers"] = _RETRY_AFTER
    return out


@functools.cache
def _component_schemas() -> dict[str, Any]:
    pairs = [(m, "validation") for m in REQUEST_MODELS]
    pairs += [(m, "serialization") for m in RESPONSE_MODELS]
    _, top = models_json_schema(pairs, ref_template=_REF)  # type: ignore[arg-type]
    return top["$defs"]


def add_openapi(app: FastAPI, secured: bool) -> None:
    """The schema FastAPI generates, plus the models our routes parse and build themselves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description="OpenAI-compatible API; see the README's HTTP section.",
                routes=app.routes,
            )
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(_component_schemas())
            if secured:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, ops in schema.get("paths", {}).items():
                    if path.startswith("/v1/") or path in KEYED_PATHS:
                        for op in ops.values():
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
