"""Shared pieces for the HTTP API hardening tests (test_api_limits.py, test_api_errors.py,
test_api_openapi.py): request bodies for the two generate routes, the check of an OpenAI 400,
and a reader of a stream's SSE events."""

from __future__ import annotations

import http.client
import json
from typing import Any

from kvmesh.cluster.response_models import ErrorResponse
from tests.openai_helpers import MODEL, USER, strict_json

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat(**fields: Any) -> tuple[str, Any]:
    return CHAT, {"model": MODEL, "messages": USER, **fields}


def complete(**fields: Any) -> tuple[str, Any]:
    return COMPLETIONS, {"model": MODEL, "prompt": "a", **fields}


def assert_bad(status: int, body: Any, param: str | None, code: int = 400) -> None:
    assert status == code, body
    ErrorResponse.model_validate(body)
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if param is not None:
        assert error["message"].startswith(f"{param}: "), error


def sse_events(port: int, path: str, body: Any) -> tuple[int, list[Any]]:
    """Status, and the parsed ``data:`` events of a stream (a JSON body when not a stream)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    if not r.getheader("content-type", "").startswith("text/event-stream"):
        return r.status, [strict_json(text)]
    datas = [ln[len("data: ") :] for ln in text.split("\n") if ln.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return r.status, [strict_json(d) for d in datas[:-1]]
