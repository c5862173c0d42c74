"""The OpenAPI schema, fuzzed: schemathesis generates requests from ``/openapi.json`` (valid
ones, and ones that break the schema) for every route and runs them in-process (ASGI)
against a LocalBackend on tiny-random, with admission as the Serve app has it. No answer may
be a 5xx, and every answer must be one the schema documents (status, content type, headers),
in its documented shape; a full server's 429 too. (bench/fuzz.py: >= 1,000 cases a route.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvmesh.cluster.admission import Admission
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from tests.openai_helpers import MODEL

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]


@pytest.fixture(scope="module")
def backend() -> Iterator[LocalBackend]:
    # A short context: a generated request generates at most 64 tokens.
    backend = LocalBackend(
        model=MODEL, block_size=4, num_kv_blocks=64, max_model_len=64, progress=False
    )
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def api_schema(backend: LocalBackend) -> Any:
    app = build_api(backend, model_name=MODEL, admission=Admission(64))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_every_route_is_fuzzed(api_schema: Any) -> None:
    ops = [op.ok() for op in api_schema.get_all_operations()]
    assert sorted((op.method.upper(), op.path) for op in ops) == sorted(ROUTES)


CASES = [(method, path, GenerationMode.POSITIVE) for method, path in ROUTES] + [
    (method, path, GenerationMode.NEGATIVE) for method, path in ROUTES if method == "POST"
]  # a GET has no invalid request to generate (a path parameter is any string)


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_route_conforms(api_schema: Any, method: str, path: str, mode: GenerationMode) -> None:
    operation = api_schema[path][method]

    @given(operation.as_strategy(generation_mode=mode))
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=CHECKS)

    run()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_full_servers_refusals_conform(backend: LocalBackend, path: str) -> None:
    """Every request to a full server is a 429 with the documented body and Retry-After."""
    admission = Admission(1)
    admission.enter()  # the one place is taken
    app = build_api(backend, model_name=MODEL, admission=admission)
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)[path]["POST"]

    @given(operation.as_strategy())
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        response = case.call_and_validate(checks=CHECKS)
        assert response.status_code == 429 and response.headers["retry-after"] == ["1"]

    run()
    assert admission.refused >= 20
