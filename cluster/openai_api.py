"""The OpenAI-compatible HTTP API over any ``Backend``: ``build_api(backend, model_name=...)``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``; the OpenAPI schema at
``/openapi.json`` (request models from ``protocol.py``, response models from
``response_models.py``) and its page at ``/docs``.

Every request is validated in full (types, model, sampling fields, prompt length against the
context) before the backend sees it, and bad input gets a 4xx with OpenAI's error body and
the offending field in ``param``: never FastAPI's 422 body, never a 500. A stream waits for
its first chunk before sending headers, so errors the backend finds at admission (such as a
request larger than the KV pool) are still a 400. A client that disconnects cancels its
request, which aborts it in the engine.

The event loop stays free for other requests: a body over ``max_request_bytes`` is refused
(413) from its Content-Length or as soon as that many bytes came in, and parsing JSON,
applying the chat template and tokenizing run in worker threads. Errors never carry internal
details: a ValueError (also one a Ray task error wraps) is a 400 with the ValueError's own
message; anything else is a 500 whose detail goes to the log only.
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
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh import __version__
from kvmesh.cluster.backend import Backend, Chunk, GenerateRequest, Unavailable
from kvmesh.cluster.metrics import CONTENT_TYPE, ServeMetrics
from kvmesh.cluster.protocol import (
    REQUEST_MODELS,
    ApiError,
    B,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    describe_errors,
    error_body,
    parse_body,
    valid,
)
from kvmesh.cluster.response_models import RESPONSE_MODELS

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
) -> FastAPI:
    """A FastAPI app serving ``backend`` as the one model ``model_name``.

    With ``api_key``, /v1/* and /metrics need ``Authorization: Bearer <api_key>`` (metrics
    name workers and show load: a scraper sends the key as a bearer token); /health, /docs
    and /openapi.json stay open (probes carry no key). A request body over
    ``max_request_bytes`` gets a 413.
    """
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int):
        raise ValueError(f"max_request_bytes: must be an integer, got {max_request_bytes!r}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes: must be at least 1, got {max_request_bytes}")
    metrics = metrics or ServeMetrics()
    app = FastAPI(title="kvmesh", version=__version__, docs_url="/docs", redoc_url=None)
    app.add_middleware(_LimitBody, max_bytes=max_request_bytes)
    app.add_middleware(_CountRequests, metrics=metrics)  # outermost: 413s count too
    _add_error_handlers(app)
    _add_openapi(app, secured=api_key is not None)

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])
    gen = _Generation(backend, metrics)
    started = int(time.time())
    statuses = (400, 401, 404, 413, 500, 503) if api_key else (400, 404, 413, 500, 503)
    errors = _error_responses(*statuses)

    @v1.post(
        "/chat/completions",
        response_model=None,
        openapi_extra=_request_body(ChatCompletionRequest),
        responses=_generation_responses("ChatCompletionResponse", "ChatCompletionChunk") | errors,
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
        openapi_extra=_request_body(CompletionRequest),
        responses=_generation_responses("CompletionResponse", "CompletionChunk") | errors,
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
        responses=_json_response("ModelList", "The one model served.")
        | _error_responses(*(401,) if api_key else ()),
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

    @app.get("/health", response_model=None, responses=_json_response("Health", "Serving."))
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=Response,
        dependencies=[Depends(check_key)],
        responses={200: {"description": "Prometheus text format.", "content": {"text/plain": {}}}}
        | _error_responses(*(401,) if api_key else ()),
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
        if not stream:
            completion = await _until_disconnect(request, self.backend.generate(req))
            self.metrics.observe_completion(completion)
            return JSONResponse(shape.response(completion, self.backend.token_texts))
        chunks = self.backend.stream(req)
        # Headers wait for the first chunk: admission errors are still a 4xx, and a client
        # that leaves while its request is queued cancels it.
        first = await _until_disconnect(request, chunks.__anext__())
        events = self._events(first, chunks, shape, include_usage)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _events(
        self,
        first: Chunk,
        chunks: AsyncIterator[Chunk],
        shape: ResponseShape,
        include_usage: bool,
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
                        token_texts=self.backend.token_texts if lp_entries else None,
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
                self.metrics.observe_completion(chunk.completion)
                if include_usage:
                    yield _sse(shape.usage_chunk(chunk.completion))
        except Exception as e:  # headers are sent: the error goes in the stream
            yield _sse(_as_api_error(e, f"stream {shape.id}").body)
        finally:
            await _aclose(chunks)
        yield "data: [DONE]\n\n"


def _chat_ids(backend: Backend, messages: list[dict[str, str]]) -> list[int]:
    try:
        return valid(lambda: backend.tokenize_chat(messages))
    except jinja2.TemplateError as e:  # templates that raise, e.g. on roles out of order
        raise ApiError(400, f"messages: {e}", param="messages") from None


def _root_cause(e: BaseException) -> BaseException:
    """``e`` itself, or the cause that a Ray task error wraps (``RayTaskError.cause``; its own
    message holds the remote traceback, pid and actor id, so the cause's is the one to show)."""
    for _ in range(8):  # RayTaskError(RayTaskError(ValueError)): a task that called a task
        cause = getattr(e, "cause", None)
        if not isinstance(cause, BaseException) or cause is e:
            break
        e = cause
    return e


def _client_error(e: BaseException) -> ValueError | None:
    """The ValueError behind ``e``, if any (see ``_root_cause``)."""
    root = _root_cause(e)
    return root if isinstance(root, ValueError) else None


def _as_api_error(e: Exception, where: str) -> ApiError:
    """ValueError (or one wrapped) -> 400 with its own message; anything else -> a 500 that
    says nothing internal, its detail logged under a reference the message gives."""
    if isinstance(e, ApiError):
        return e
    bad = _client_error(e)
    if bad is not None:
        return ApiError.bad_input(bad)
    root = _root_cause(e)
    if isinstance(root, Unavailable):
        return ApiError(503, str(root), "server_error", code="unavailable")
    ref = uuid.uuid4().hex[:12]
    logger.error("%s failed (ref %s)", where, ref, exc_info=e)
    return ApiError(500, f"internal server error (ref {ref})", "server_error")


async def _call_backend(aw: Awaitable[T]) -> T:
    """Await the backend: ValueError -> 400, anything else unexpected -> logged 500."""
    try:
        return await aw
    except StopAsyncIteration:
        raise ApiError(500, "the backend's stream ended without output", "server_error") from None
    except Exception as e:
        raise _as_api_error(e, "backend call") from None


async def _until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await the backend, cancelling it (so the engine aborts the request) when the client
    disconnects first. Starlette cancels nothing before a response starts, hence this."""
    task = asyncio.ensure_future(_call_backend(aw))
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


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, ApiError)
        return JSONResponse(e.body, status_code=e.status)

    async def http_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, StarletteHTTPException)
        type_ = "server_error" if e.status_code >= 500 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), type_), status_code=e.status_code, headers=e.headers
        )

    async def validation_error(request: Request, e: Exception) -> Response:
        # FastAPI answers 422 with its own body; OpenAI and vLLM answer 400 with theirs.
        assert isinstance(e, RequestValidationError)
        message, param = describe_errors(e.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    async def unexpected(request: Request, e: Exception) -> Response:
        assert isinstance(e, Exception)
        error = _as_api_error(e, f"{request.method} {request.url.path}")
        return JSONResponse(error.body, status_code=error.status)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


# -- OpenAPI ----------------------------------------------------------------------------------

_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _request_body(model: type[Any]) -> dict[str, Any]:
    """openapi_extra for a route that parses its own body (off the event loop)."""
    content = {"application/json": {"schema": _ref(model.__name__)}}
    return {"requestBody": {"required": True, "content": content}}


def _json_response(name: str, description: str) -> dict[int | str, Any]:
    return {
        200: {"description": description, "content": {"application/json": {"schema": _ref(name)}}}
    }


def _generation_responses(full: str, chunk: str) -> dict[int | str, Any]:
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
    500: "Internal error; the detail is in the server's log.",
    503: "The request could not be finished now (its worker was lost too often); the "
    "message names the cause.",
}


def _error_responses(*statuses: int) -> dict[int | str, Any]:
    content = {"application/json": {"schema": _ref("ErrorResponse")}}
    return {s: {"description": _ERRORS[s], "content": content} for s in statuses}


@functools.cache
def _component_schemas() -> dict[str, Any]:
    pairs = [(m, "validation") for m in REQUEST_MODELS]
    pairs += [(m, "serialization") for m in RESPONSE_MODELS]
    _, top = models_json_schema(pairs, ref_template=_REF)  # type: ignore[arg-type]
    return top["$defs"]


def _add_openapi(app: FastAPI, secured: bool) -> None:
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
                    if path.startswith("/v1/") or path == "/metrics":
                        for op in ops.values():
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# -- ASGI middleware --------------------------------------------------------------------------


class _LimitBody:
    """ASGI middleware: refuse a request body over ``max_bytes`` with a 413, from its
    Content-Length before reading anything, or as soon as a chunked body passes the limit.
    What it admits it has read whole, and hands on as one message; later ``receive`` calls
    (the disconnect that cancels a request) go to the server as before."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body was in
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: dict[str, Any] | None = {"type": "http.request", "body": b"".join(chunks)}
        chunks.clear()

        async def replay() -> dict[str, Any]:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # then the disconnect, as from the server

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = error_body(
            f"request body: larger than the limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        await JSONResponse(body, status_code=413)(scope, receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses such a request before it reaches us
    return None


class _CountRequests:
    """ASGI middleware: count requests by route template and status (pure ASGI, not
    BaseHTTPMiddleware, so streams and disconnect cancellation pass through untouched)."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe_request(route, status)
