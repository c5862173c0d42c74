"""ASGI middleware of the HTTP API: the body's limit (413) and coding (415), request counting,
and a lost Serve proxy read as the client's leaving. Pure ASGI, not ``BaseHTTPMiddleware``, so
streams and the disconnect that cancels a request pass through untouched. (Admission lives in
``admission.py``.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError

from kvmesh.cluster.api_error import error_body
from kvmesh.cluster.metrics import ServeMetrics


class ClientSide:
    """The loss of Serve's proxy that holds a request's connection (its actor died: Serve
    restarts it) reads, in ``receive``, as the client's leaving, which it is: the request is
    cancelled as a client's, instead of failing as the server's fault with a 500 to nobody
    and a traceback in the log."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def receive_or_gone() -> dict[str, Any]:
            try:
                return await receive()
            except RayActorError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_gone if scope["type"] == "http" else receive, send)


class LimitBody:
    """Refuse a request body over ``max_bytes`` with a 413, from its Content-Length before
    reading anything, or as soon as a chunked body passes the limit; and one in a content
    coding (``Content-Encoding: gzip``) with a 415, before reading it, rather than a 400 that
    calls compressed JSON invalid. What it admits it has read whole, and hands on as one
    message; later ``receive`` calls (the disconnect that cancels a request) go to the server
    as before."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        coding = _header(scope, b"content-encoding")
        if coding is not None and coding.strip().lower() not in (b"", b"identity"):
            await self._refuse_coding(coding, scope, receive, send)
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

    @staticmethod
    async def _refuse_coding(coding: bytes, scope: dict, receive: Callable, send: Callable) -> None:
        name = coding.decode("latin-1").strip()
        shown = repr(name if len(name) <= 32 else name[:32] + "...")
        body = error_body(
            f"request body: Content-Encoding {shown} is not supported; send it uncompressed",
            code="unsupported_content_encoding",
        )
        # RFC 9110, 15.5.16: a 415 for a content coding names the codings accepted.
        headers = {"Accept-Encoding": "identity"}
        await JSONResponse(body, status_code=415, headers=headers)(scope, receive, send)


def _header(scope: dict, wanted: bytes) -> bytes | None:
    """The first value of a request header (ASGI gives names lowercased)."""
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return value
    return None


def _content_length(scope: dict) -> int | None:
    value = _header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None  # the server refuses such a request before it reaches us


class CountRequests:
    """Count requests by route template and status. A request answered before routing (a
    refusal by admission) counts under its path when that is one of ``paths``."""

    def __init__(self, app: Any, metrics: ServeMetrics, paths: Collection[str] = ()) -> None:
        self.app, self.metrics, self.paths = app, metrics, frozenset(paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The outermost middleware: the request's arrival, for TTFT as the client sees it
        # (``request.state.received``).
        scope.setdefault("state", {})["received"] = time.perf_counter()
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is None:
                route = scope.get("path") if scope.get("path") in self.paths else "unmatched"
            self.metrics.observe_request(route, status)
