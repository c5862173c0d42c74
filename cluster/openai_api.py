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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Annotated, Any, TypeVar

import anyio.to_thread
import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh import __version__
from kvmesh.cluster.admission import GENERATION_PATHS, Admission, AdmitRequests
from kvmesh.cluster.api_error import ApiError, valid
from kvmesh.cluster.backend import Backend, Chunk, Completion, GenerateRequest
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
        reqs = [
            GenerateRequest(choice_id(rid, i, body.n), p, messages=messages, prompt_ids=ids)
            for i, p in enumerate(body.per_choice(params))
        ]
        shape = ResponseShape("chat", rid, model_name, body.num_logprobs(), body.n)
        return await gen.run(request, reqs, shape, body.stream, body.include_usage)

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
        prompts = body.prompts()
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = []
        for prompt in prompts:  # every prompt checked before any runs: a bad one runs none
            ids = await _in_thread(valid, lambda p=prompt: backend.tokenize(p))
            params = body.sampling_params(len(ids), backend.max_model_len)
            choices = len(prompts) * body.n
            reqs += [
                GenerateRequest(
                    choice_id(rid, len(reqs) + i, choices), p, prompt=prompt, prompt_ids=ids
                )
                for i, p in enumerate(body.per_choice(params))
            ]
        shape = ResponseShape("text", rid, model_name, body.num_logprobs(), body.n)
        return await gen.run(request, reqs, shape, body.stream, body.include_usage)

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
    """Runs a validated request's choices on the backend (one backend request each) and
    answers, as JSON or as one stream that interleaves the choices' chunks."""

    def __init__(self, backend: Backend, metrics: ServeMetrics) -> None:
        self.backend, self.metrics = backend, metrics

    async def run(
        self,
        request: Request,
        reqs: list[GenerateRequest],
        shape: ResponseShape,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        received = getattr(request.state, "received", time.perf_counter())
        if not stream:
            completions = await _until_disconnect(
                request, _all([self.backend.generate(r) for r in reqs])
            )
            for c in completions:
                self.metrics.observe_completion(c, time.perf_counter() - received - c.decode_s)
            return JSONResponse(shape.response(completions, self.backend))
        streams = [self.backend.stream(r) for r in reqs]
        try:
            # Headers wait for every choice's first chunk: admission errors are still a 4xx,
            # and a client that leaves while its request is queued cancels it.
            firsts = await _until_disconnect(request, _all([s.__anext__() for s in streams]))
        except BaseException:
            await _aclose_all(streams)
            raise
        chunks = _interleaved(firsts, streams)
        events = self._events(chunks, streams, shape, include_usage, time.perf_counter() - received)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _events(
        self,
        chunks: AsyncGenerator[tuple[int, Chunk], None],
        streams: list[AsyncIterator[Chunk]],
        shape: ResponseShape,
        include_usage: bool,
        ttft_s: float,
    ) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}  # OpenAI: null until the last
        now = time.perf_counter()
        last = [now] * len(streams)
        # Tokens whose text is held back (a partial character, a possible stop string) send
        # no chunk: their logprobs ride with the choice's next chunk that has text.
        lp_ids: list[list[int]] = [[] for _ in streams]
        lp_entries: list[list[dict[int, float]]] = [[] for _ in streams]
        completions: list[Completion | None] = [None] * len(streams)
        first = [True] * len(streams)
        try:
            if shape.kind == "chat":
                for i in range(len(streams)):
                    yield _sse(shape.chunk("", index=i, role=True) | extra)
            async for i, chunk in chunks:
                if first[i]:
                    first[i] = False
                else:
                    now = time.perf_counter()
                    self.metrics.observe_inter_token(now - last[i], len(chunk.token_ids))
                    last[i] = now
                if chunk.logprobs is not None:
                    lp_ids[i] += chunk.token_ids
                    lp_entries[i] += chunk.logprobs
                if chunk.text or chunk.finish_reason is not None:
                    logprobs = (lp_ids[i], lp_entries[i]) if lp_entries[i] else None
                    piece = shape.chunk(
                        chunk.text,
                        chunk.finish_reason,
                        index=i,
                        completion=chunk.completion,
                        logprobs=logprobs,
                        vocab=self.backend if logprobs else None,
                    )
                    lp_ids[i], lp_entries[i] = [], []
                    yield _sse(piece | extra)
                if chunk.completion is not None:
                    completions[i] = chunk.completion
                    self.metrics.observe_completion(chunk.completion, ttft_s)
            done = [c for c in completions if c is not None]
            if include_usage and len(done) == len(streams):
                yield _sse(shape.usage_chunk(done))
        except Exception as e:  # headers are sent: the error goes in the stream
            yield _sse(as_api_error(e, f"stream {shape.id}").body)
        finally:
            await chunks.aclose()  # its pending reads first, then the streams
            await _aclose_all(streams)
        yield "data: [DONE]\n\n"


def choice_id(request_id: str, index: int, choices: int) -> str:
    """The backend request id of choice ``index``: the response's own id when it is the
    only choice."""
    return request_id if choices == 1 else f"{request_id}-{index}"


async def _all(aws: list[Awaitable[T]]) -> list[T]:
    """Every result, in order. The first error (or a cancellation) cancels the rest, so no
    choice runs on for a response that will not come."""
    tasks = [asyncio.ensure_future(call_backend(a)) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _cancel(tasks)


async def _cancel(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until they are over: a stream whose ``__anext__`` is still
    running cannot be closed."""
    tasks = [t for t in tasks if not t.done()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _interleaved(
    firsts: list[Chunk], streams: list[AsyncIterator[Chunk]]
) -> AsyncGenerator[tuple[int, Chunk], None]:
    """(choice, chunk) from every stream as each chunk comes, each stream's first chunk
    (already awaited) first, until every stream has finished."""
    for i, chunk in enumerate(firsts):
        yield i, chunk
    live = [i for i, c in enumerate(firsts) if c.finish_reason is None]
    if len(streams) == 1:  # one choice: no task per chunk
        while live:
            chunk = await call_backend(streams[0].__anext__())
            yield 0, chunk
            if chunk.finish_reason is not None:
                break
        return
    pending = {asyncio.ensure_future(call_backend(streams[i].__anext__())): i for i in live}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                chunk = task.result()
                yield i, chunk
                if chunk.finish_reason is None:
                    pending[asyncio.ensure_future(call_backend(streams[i].__anext__()))] = i
    finally:
        await _cancel(pending)


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


async def _aclose_all(streams: list[AsyncIterator[Any]]) -> None:
    for it in streams:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
