"""Runs a validated request's choices on a ``Backend`` and answers: one JSON response, or
one server-sent-event stream that interleaves the choices' chunks (``Generation``).

Each choice is a backend request of its own. Whole responses await them together (``_all``:
the first error cancels the rest); streams wait for every choice's first chunk before
headers go out (so admission errors are still a 4xx), then merge the choices as their chunks
come (``_interleaved``). A client that disconnects cancels every choice, which aborts them in
the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.cluster.admission import hold_places
from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.backend import Backend, Chunk, Completion, GenerateRequest
from kvmesh.cluster.http_errors import as_api_error, call_backend
from kvmesh.cluster.metrics import ServeMetrics
from kvmesh.cluster.response_shape import ResponseShape

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Opened:
    """A request's choices as streams, each with its first chunk (already awaited)."""

    firsts: list[Chunk]
    streams: list[AsyncIterator[Chunk]]


class Generation:
    """Runs a validated request's choices on the backend (one backend request each) and
    answers: ``answer`` gives OpenAI's response as a dict, ``open`` then ``chunks`` its
    stream's chunks as dicts (choices interleaved); ``run`` answers over HTTP (JSON, or
    server-sent events) with them. The Python handle uses them directly."""

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
        hold_places(request.scope, len(reqs))  # admission counts sequences: one per choice
        if not stream:
            answer = await _until_disconnect(request, self.answer(reqs, shape, received))
            return JSONResponse(answer)
        # Headers wait for every choice's first chunk: admission errors are still a 4xx, and
        # a client that leaves while its request is queued cancels it.
        opened = await _until_disconnect(request, self.open(reqs, shape))
        return StreamingResponse(
            _sse_events(self.chunks(opened, shape, include_usage, received), shape.id),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def answer(
        self, reqs: list[GenerateRequest], shape: ResponseShape, received: float
    ) -> dict[str, Any]:
        """OpenAI's response for every choice (``received``: when the request came, on
        ``time.perf_counter``'s clock, for the TTFT metric)."""
        with shape.refusals():
            completions = await _all([self.backend.generate(r) for r in reqs])
        for c in completions:
            self.metrics.observe_completion(c, time.perf_counter() - received - c.decode_s)
        return shape.response(completions, self.backend)

    async def open(self, reqs: list[GenerateRequest], shape: ResponseShape) -> Opened:
        """Every choice's stream with its first chunk; an error here closes them all."""
        streams = [self.backend.stream(r) for r in reqs]
        try:
            with shape.refusals():
                return Opened(await _all([s.__anext__() for s in streams]), streams)
        except BaseException:
            await _aclose_all(streams)
            raise

    async def chunks(
        self, opened: Opened, shape: ResponseShape, include_usage: bool, received: float
    ) -> AsyncGenerator[dict[str, Any], None]:
        """OpenAI's stream chunks for every opened choice, interleaved as they come; the
        usage chunk last with ``include_usage``. Closing it aborts every choice."""
        ttft_s = time.perf_counter() - received
        interleaved = _interleaved(opened.firsts, opened.streams)
        try:
            pieces = self._pieces(interleaved, len(opened.streams), shape, include_usage, ttft_s)
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    yield piece
        finally:
            try:
                await interleaved.aclose()  # its pending reads first, then the streams
            finally:
                await _aclose_all(opened.streams)

    async def _pieces(
        self,
        chunks: AsyncIterator[tuple[int, Chunk]],
        n: int,
        shape: ResponseShape,
        include_usage: bool,
        ttft_s: float,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The stream's chunks from ``n`` choices' interleaved engine chunks; each choice's
        latencies go to the metrics as it comes."""
        extra = {"usage": None} if include_usage else {}  # OpenAI: null until the last
        now = time.perf_counter()
        last = [now] * n
        # Tokens whose text is held back (a partial character, a possible stop string) send
        # no chunk: their logprobs ride with the choice's next chunk that has text.
        lp_ids: list[list[int]] = [[] for _ in range(n)]
        lp_entries: list[list[dict[int, float]]] = [[] for _ in range(n)]
        completions: list[Completion | None] = [None] * n
        first = [True] * n
        echoed = [shape.echo is None] * n  # echo: the prompt goes out with the first tokens
        if shape.kind == "chat":
            for i in range(n):
                yield shape.chunk("", index=i, role=True) | extra
        async for i, chunk in chunks:
            chunk = shape.shown_chunk(chunk)
            if first[i]:
                first[i] = False
            else:
                now = time.perf_counter()
                self.metrics.observe_inter_token(now - last[i], len(chunk.token_ids))
                last[i] = now
            if not echoed[i] and (chunk.token_ids or chunk.finish_reason is not None):
                echoed[i] = True  # the prompt's logprobs come with the first tokens
                yield shape.echo_chunk(i, chunk.prompt_logprobs, self.backend) | extra
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
                yield piece | extra
            if chunk.completion is not None:
                completions[i] = chunk.completion
                self.metrics.observe_completion(chunk.completion, ttft_s)
        done = [c for c in completions if c is not None]
        if include_usage and len(done) == n:
            yield shape.usage_chunk(done)


async def _sse_events(
    chunks: AsyncGenerator[dict[str, Any], None], request_id: str
) -> AsyncIterator[str]:
    """Server-sent events: each chunk, then ``[DONE]``. Headers are sent by now, so an error
    goes in the stream as OpenAI's error body."""
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except Exception as e:
        yield _sse(as_api_error(e, f"stream {request_id}").body)
    finally:
        await chunks.aclose()
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


async def _until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await the backend, cancelling it (so the engine aborts the request) when the client
    disconnects first. Starlette cancels nothing before a response starts, hence this."""
    task = asyncio.ensure_future(call_backend(aw))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        # A cancel lands at the task's next step: until then it is neither done nor
        # cancelled (reading its result there raised InvalidStateError, logged as a 500 for
        # a client that had left).
        await _cancel([task])
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
    """One event. JSON has no NaN or Infinity: a chunk holding one is the server's fault (a
    500 error event, as a whole response holding one is a 500), never invalid JSON."""
    try:
        return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"
    except ValueError as e:
        raise RuntimeError(f"a stream chunk is not JSON: {e}") from None
