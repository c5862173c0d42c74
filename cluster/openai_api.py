"""The OpenAI-compatible HTTP API over any ``Backend``: ``build_api(backend, model_name=...)``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics``, vLLM's
``POST /tokenize`` and ``POST /detokenize`` (``tokenize_api.py``); the OpenAPI schema at
``/openapi.json`` (``openapi_doc.py``) and its page at ``/docs``.

Every request is validated in full (types, model, sampling fields, prompt length against the
context) before the backend sees it, and bad input gets a 4xx with OpenAI's error body and
the offending field in ``param``: never FastAPI's 422 body, never a 500. A body becomes its
choices' backend requests in ``openai_requests.py``; running them and answering (JSON or a
stream) is ``generation.py``.

With an ``Admission``, the generation routes admit a bounded number of sequences at once
and refuse the rest at once with a 429 and ``Retry-After`` (``admission.py``).

The event loop stays free for other requests: a body over ``max_request_bytes`` is refused
(413) from its Content-Length or as soon as that many bytes came in, a compressed one (415)
before it is read, and parsing JSON, applying the chat template and tokenizing run in worker
threads. Errors never carry internal details (``http_errors.py``).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from kvmesh import __version__
from kvmesh.cluster.admission import GENERATION_PATHS, Admission, AdmitRequests
from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.backend import Backend
from kvmesh.cluster.generate_body import model_not_found
from kvmesh.cluster.generation import Generation
from kvmesh.cluster.http_errors import (
    OVERLOADED_STATUS,
    add_error_handlers,
)
from kvmesh.cluster.http_middleware import ClientSide, CountRequests, LimitBody
from kvmesh.cluster.metrics import CONTENT_TYPE, ServeMetrics
from kvmesh.cluster.openai_requests import chat_choices, completion_choices
from kvmesh.cluster.openapi_doc import (
    add_openapi,
    error_responses,
    generation_responses,
    json_response,
    request_body,
)
from kvmesh.cluster.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.cluster.request_parsing import json_body
from kvmesh.cluster.tokenize_api import add_tokenize_routes

logger = logging.getLogger(__name__)
# Holds a full 128k-token context as text, as \u-escaped non-ASCII text or as token ids.
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024


def build_api(
    backend: Backend,
    *,
    model_name: str,
    api_key: str | None = None,
    metrics: ServeMetrics | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    admission: Admission | None = None,
    announce_limit: int | None = None,
) -> FastAPI:
    """A FastAPI app serving ``backend`` as the one model ``model_name``.

    With ``api_key``, /v1/*, /metrics, /tokenize and /detokenize need ``Authorization: Bearer
    <api_key>`` (metrics name workers and show load: a scraper sends the key as a bearer
    token); /health, /docs
    and /openapi.json stay open (probes carry no key). A request body over
    ``max_request_bytes`` gets a 413. With ``admission``, the generation routes admit at
    most its limit at once and answer the rest 429 with ``Retry-After`` at once; with
    ``announce_limit`` too, their answers name it (all ingress replicas' limit) for the
    front door in Serve's proxy (``front_door.py``).
    """
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int):
        raise ValueError(f"max_request_bytes: must be an integer, got {max_request_bytes!r}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes: must be at least 1, got {max_request_bytes}")
    metrics = metrics or ServeMetrics()
    app = FastAPI(title="kvmesh", version=__version__, docs_url="/docs", redoc_url=None)
    # The last added runs first: count everything, refuse overload before reading a body.
    app.add_middleware(LimitBody, max_bytes=max_request_bytes)
    if admission is not None:
        app.add_middleware(
            AdmitRequests, admission=admission, paths=GENERATION_PATHS, announce=announce_limit
        )
    app.add_middleware(CountRequests, metrics=metrics, paths=GENERATION_PATHS)
    app.add_middleware(ClientSide)
    add_error_handlers(app)
    add_openapi(app, secured=api_key is not None)

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        # RFC 7235: the scheme is case-insensitive ("bearer" too); the key is not, and is
        # compared in constant time. RFC 6750 allows more than one space before it.
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            given.lstrip(" ").encode(), api_key.encode()
        ):
            raise ApiError(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])
    gen = Generation(backend, metrics)
    started = int(time.time())
    statuses = [400, *([401] if api_key else []), 404, 413, 415]
    statuses += [*([OVERLOADED_STATUS] if admission is not None else []), 500, 503]
    errors = error_responses(*statuses)

    @v1.post(
        "/chat/completions",
        response_model=None,
        openapi_extra=request_body(ChatCompletionRequest),
        responses=generation_responses("ChatCompletionResponse", "ChatCompletionChunk") | errors,
    )
    async def chat_completions(
        request: Request,
        body: Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))],
    ) -> Response:
        """Chat completion (OpenAI's), streamed as server-sent events with `stream`."""
        reqs, shape = await chat_choices(backend, body, model_name)
        return await gen.run(request, reqs, shape, body.stream, body.include_usage)

    @v1.post(
        "/completions",
        response_model=None,
        openapi_extra=request_body(CompletionRequest),
        responses=generation_responses("CompletionResponse", "CompletionChunk") | errors,
    )
    async def completions(
        request: Request,
        body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
    ) -> Response:
        """Text completion (OpenAI's legacy endpoint), streamed with `stream`."""
        reqs, shape = await completion_choices(backend, body, model_name)
        return await gen.run(request, reqs, shape, body.stream, body.include_usage)

    @v1.get(
        "/models",
        response_model=None,
        responses=json_response("ModelList", "The one model served.")
        | error_responses(*(401,) if api_key else ()),
    )
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    # OpenAI's "retrieve model" (the openai client's models.retrieve); `:path` because a
    # served name may hold a slash, as Hugging Face names do.
    @v1.get(
        "/models/{model:path}",
        response_model=None,
        responses=json_response("ModelCard", "The model, when it is the one served.")
        | error_responses(*(401,) if api_key else (), 404),
    )
    async def model(model: str) -> dict[str, Any]:
        if model != model_name:
            raise model_not_found(model, model_name)
        return card()

    def card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "kvmesh",
            "max_model_len": backend.max_model_len,
        }

    @app.get("/health", response_model=None, responses=json_response("Health", "Serving."))
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=Response,
        dependencies=[Depends(check_key)],
        responses={200: {"description": "Prometheus text format.", "content": {"text/plain": {}}}}
        | error_responses(*(401,) if api_key else ()),
    )
    async def prometheus() -> Response:
        try:
            metrics.set_stats(await backend.stats())
        except Exception:  # a scrape still answers with what the front end knows
            logger.exception("backend.stats() failed")
            metrics.set_stats(None)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(v1)
    tokenize_errors = error_responses(400, *(401,) if api_key else (), 404, 413, 415, 500)
    add_tokenize_routes(app, backend, model_name, [Depends(check_key)], tokenize_errors)
    return app
