"""The OpenAI-compatible HTTP API over any ``Backend``: ``build_api(backend, model_name=...)``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``; the OpenAPI schema at
``/openapi.json`` (``openapi_doc.py``) and its page at ``/docs``.

Every request is validated in full (types, model, sampling fields, prompt length against the
context) before the backend sees it, and bad input gets a 4xx with OpenAI's error body and
the offending field in ``param``: never FastAPI's 422 body, never a 500. A stream waits for
its first chunk before sending headers, so errors the backend finds at admission (such as a
request larger than the KV pool) are still a 400. A client that disconnects cancels its
request, which aborts it in the engine.

With an ``Admission``, the generation routes admit a bounded number of requests at once and
refuse the rest at once with a 429 and ``Retry-After`` (``admission.py``).

The event loop stays free for other requests: a body over ``max_request_bytes`` is refused
(413) from its Content-Length or as soon as that many bytes came in, and parsing JSON,
applying the chat template and tokenizing run in worker threads. Errors never carry internal
details (``http_errors.py``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar

import anyio.to_thread
import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh import __version__
from kvmesh.cluster.admission import GENERATION_PATHS, Admission, AdmitRequests
from kvmesh.cluster.api_error import ApiError, valid
from kvmesh.cluster.backend import Backend, Chunk, GenerateRequest
from kvmesh.cluster.http_errors import (
    OVERLOADED_STATUS,
    add_error_handlers,
    as_api_error,
    call_backend,
)
from kvmesh.cluster.http_middleware import CountRequests, LimitBody
from kvmesh.cluster.metrics import CONTENT_TYPE, ServeMetrics
from kvmesh.cluster.openapi_doc import (
    add_openapi,
    error_responses,
    generation_responses,
    json_response,
    request_body,
)
from kvmesh.cluster.protocol import B, ChatCompletionRequest, CompletionRequest, parse_body
from kvmesh.cluster.response_shape import ResponseShape

logger = logging.getLogger(__name__)
T = TypeVar("T")
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
) -> FastAPI:
    """A FastAPI app serving ``backend`` as the one model ``model_name``.

    With ``api_key``, /v1/* and /metrics need ``Authorization: Bearer <api_key>`` (metrics
    name workers and show load: a scraper sends the key as a bearer token); /health, /docs
    and /openapi.json stay open (probes carry no key). A request body over
    ``max_request_bytes`` gets a 413. With ``admission``, the generation routes admit at
    most its limit at once and answer the rest 429 with ``Retry-After`` at once.
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
        app.add_middleware(AdmitRequests, admission=admission, paths=GENERATION_PATHS)
    app.add_middleware(CountRequests, metrics=metrics, paths=GENERATION_PATHS)
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
    gen = _Generation(backend, metrics)
    started = int(time.time())
    statuses = [400, *([401] if api_key else []), 404, 413]
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
        body: Annotated[ChatCompletionRequest, Depends(_json_body(ChatCompletionRequest))],
    ) -> Response:
        """Chat completion (OpenAI's), streamed as server-sent events with `stream`."""
        body.check(model_name)
        messages = body.message_dicts()
        ids = await _in_thread(_chat_ids, backend, messages)
        params = body.sampling_params(len(ids), backend.max_model_len)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req = GenerateRequest(rid, params, messages=messages, prompt_ids=ids)
        shape = ResponseShape("chat", req.request_id, model_name, body.num_logprobs())
        return await gen.run(request, req, shape, body.stream, body.include_usage)

    @v1.post(
        "/completions",
        response_model=None,
        openapi_extra=request_body(CompletionRequest),
        responses=generation_responses("CompletionResponse", "CompletionChunk") | errors,
    )
    async def completions(
        request: Request,
        body: Annotated[CompletionRequest, Depends(_json_body(CompletionRequest))],
    ) -> Response:
        """Text completion (OpenAI's legacy endpoint), streamed with `stream`."""
        body.check(model_name)
        prompt = body.single_prompt()
        ids = await _in_thread(valid, lambda: backend.tokenize(prompt))
        params = body.sampling_params(len(ids), backend.max_model_len)
        req = GenerateRequest(f"cmpl-{uuid.uuid4().hex}", params, prompt=prompt, prompt_ids=ids)
        shape = ResponseShape("text", req.request_id, model_name, body.num_logprobs())
        return await gen.run(request, req, shape, body.stream, body.include_usage)

    @v1.get(
        "/models",
        response_model=None,
        responses=json_response("ModelList", "The one model served.")
        | error_responses(*(401,) if api_key else ()),
    )
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "kvmesh",
            "max_model_len": backend.max_model_len,
        }
        return {"object": "list", "data": [card]}

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
    return app


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread: CPU work (JSON, templates, tokenizers) must not
    hold up the event loop, where /health and every stream run."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args))


def _json_body(model: type[B]) -> Callable[[Request], Awaitable[B]]:
    """A dependency: the request body parsed as ``model`` (in a thread; a 400 naming the
    field when it does not parse). The body is whole already: ``_LimitBody`` read it."""

    async def read(request: Request) -> B:
        return await _in_thread(parse_body, await request.body(), model)

    return read


class _Generation:
    """Runs a validated request on the backend and answers, as JSON or as a stream."""

    def __init__(self, backend: Backend, metrics: ServeMetrics) -> None:
        self.backend, self.metrics = backend, metrics

    async def run(
        self,
        request: Request,
        req: GenerateRequest,
        shape: ResponseShape,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        received = getattr(request.state, "received", time.perf_counter())
        if not stream:
            completion = await _until_disconnect(request, self.backend.generate(req))
            ttft = time.perf_counter() - received - completion.decode_s
            self.metrics.observe_completion(completion, ttft)
            return JSONResponse(shape.response(completion, self.backend))
        chunks = self.backend.stream(req)
        # Headers wait for the first chunk: admission errors are still a 4xx, and a client
        # that leaves while its request is queued cancels it.
        first = await _until_disconnect(request, chunks.__anext__())
        events = self._events(first, chunks, shape, include_usage, time.perf_counter() - received)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _events(
        self,
        first: Chunk,
        chunks: AsyncIterator[Chunk],
        shape: ResponseShape,
        include_usage: bool,
        ttft_s: float,
    ) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}  # OpenAI: null until the last
        chunk, last = first, time.perf_counter()
        # Tokens whose text is held back (a partial character, a possible stop string) send
        # no chunk: their logprobs ride with the next chunk that has text.
        lp_ids: list[int] = []
        lp_entries: list[dict[int, float]] = []
        try:
            if shape.kind == "chat":
                yield _sse(shape.chunk("", role=True) | extra)
            while True:
                if chunk.logprobs is not None:
                    lp_ids += chunk.token_ids
                    lp_entries += chunk.logprobs
                if chunk.text or chunk.finish_reason is not None:
                    piece = shape.chunk(
                        chunk.text,
                        chunk.finish_reason,
                        completion=chunk.completion,
                        logprobs=(lp_ids, lp_entries) if lp_entries else None,
                        vocab=self.backend if lp_entries else None,
                    )
                    lp_ids, lp_entries = [], []
                    yield _sse(piece | extra)
                if chunk.finish_reason is not None:
                    break
                chunk = await chunks.__anext__()
                now = time.perf_counter()
                self.metrics.observe_inter_token(now - last, len(chunk.token_ids))
                last = now
            if chunk.completion is not None:
                self.metrics.observe_completion(chunk.completion, ttft_s)
                if include_usage:
                    yield _sse(shape.usage_chunk(chunk.completion))
        except Exception as e:  # headers are sent: the error goes in the stream
            yield _sse(as_api_error(e, f"stream {shape.id}").body)
        finally:
            await _aclose(chunks)
        yield "data: [DONE]\n\n"


def _chat_ids(backend: Backend, messages: list[dict[str, str]]) -> list[int]:
    try:
        return valid(lambda: backend.tokenize_chat(messages))
    except jinja2.TemplateError as e:  # templates that raise, e.g. on roles out of order
        raise ApiError(400, f"messages: {e}", param="messages") from None


async def _until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await the backend, cancelling it (so the engine aborts the request) when the client
    disconnects first. Starlette cancels nothing before a response starts, hence this."""
    task = asyncio.ensure_future(call_backend(aw))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ApiError(499, "client disconnected")  # nobody reads it; for the logs/metrics
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client is gone. The body was read already, so the next ASGI message
    is the disconnect (uvicorn and Ray Serve's proxy both block until then)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a broken receive tells nothing: never cancel on it
        logger.debug("receive failed while waiting for a disconnect", exc_info=True)
        await asyncio.Event().wait()


async def _aclose(it: AsyncIterator[Any]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
