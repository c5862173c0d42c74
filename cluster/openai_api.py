"""The OpenAI-compatible HTTP API over any ``Backend``: ``build_api(backend, model_name=...)``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Every request is validated in full (types, model, sampling fields, prompt length against the
context) before the backend sees it, and bad input gets a 4xx with OpenAI's error body and
the offending field in ``param``: never FastAPI's 422 body, never a 500. A stream waits for
its first chunk before sending headers, so errors the backend finds at admission (such as a
request larger than the KV pool) are still a 400. A client that disconnects cancels its
request, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.cluster.backend import Backend, Chunk, GenerateRequest
from kvmesh.cluster.metrics import CONTENT_TYPE, ServeMetrics
from kvmesh.cluster.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    error_body,
    parse_body,
    valid,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


def build_api(
    backend: Backend,
    *,
    model_name: str,
    api_key: str | None = None,
    metrics: ServeMetrics | None = None,
) -> FastAPI:
    """A FastAPI app serving ``backend`` as the one model ``model_name``.

    With ``api_key``, /v1/* needs ``Authorization: Bearer <api_key>``; /health and /metrics
    stay open (probes and scrapers carry no key).
    """
    metrics = metrics or ServeMetrics()
    app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None)
    app.add_middleware(_CountRequests, metrics=metrics)
    _add_error_handlers(app)

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

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        body.check(model_name)
        messages = body.message_dicts()
        ids = _chat_ids(backend, messages)
        params = body.sampling_params(len(ids), backend.max_model_len)
        req = GenerateRequest(f"chatcmpl-{uuid.uuid4().hex}", params, messages=messages)
        shape = ResponseShape("chat", req.request_id, model_name, body.num_logprobs())
        return await gen.run(request, req, shape, body.stream, body.include_usage)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        body.check(model_name)
        prompt = body.single_prompt()
        ids = valid(lambda: backend.tokenize(prompt))
        params = body.sampling_params(len(ids), backend.max_model_len)
        req = GenerateRequest(f"cmpl-{uuid.uuid4().hex}", params, prompt=prompt)
        shape = ResponseShape("text", req.request_id, model_name, body.num_logprobs())
        return await gen.run(request, req, shape, body.stream, body.include_usage)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "kvmesh",
            "max_model_len": backend.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            metrics.set_stats(await backend.stats())
        except Exception:  # a scrape still answers with what the front end knows
            logger.exception("backend.stats() failed")
            metrics.set_stats(None)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(v1)
    return app


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
            logger.exception("stream %s failed", shape.id)
            yield _sse(error_body(f"stream failed: {e}", "server_error"))
        finally:
            await _aclose(chunks)
        yield "data: [DONE]\n\n"


def _chat_ids(backend: Backend, messages: list[dict[str, str]]) -> list[int]:
    try:
        return valid(lambda: backend.tokenize_chat(messages))
    except jinja2.TemplateError as e:  # templates that raise, e.g. on roles out of order
        raise ApiError(400, f"messages: {e}", param="messages") from None


async def _call_backend(aw: Awaitable[T]) -> T:
    """Await the backend: ValueError -> 400, anything else unexpected -> logged 500."""
    try:
        return await aw
    except ApiError:
        raise
    except ValueError as e:
        raise ApiError.bad_input(e) from None
    except StopAsyncIteration:
        raise ApiError(500, "the backend's stream ended without output", "server_error") from None
    except Exception as e:
        logger.exception("backend failed")
        raise ApiError(500, f"internal error: {e}", "server_error") from None


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
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    async def unexpected(request: Request, e: Exception) -> Response:
        logger.error("unhandled error on %s", request.url.path, exc_info=e)
        return JSONResponse(error_body(f"internal error: {e}", "server_error"), status_code=500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


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
