"""Admission: a bound on the generation requests one ingress replica holds at once.

A request is admitted when it arrives (before its body is read or parsed) and holds its
place until its answer is sent in full (the last event of a stream) or its client left.
Past the limit it is refused at once, a 429 with ``Retry-After`` and OpenAI's error body
(``Overloaded``): it never waits in a queue nobody bounds, and what was admitted keeps a
latency bounded by what the workers run at once plus ``max_queued_requests`` waiting
(``ServeConfig.admission_limit``).

Both entry points share one ``Admission``: the HTTP routes through ``AdmitRequests`` (ASGI
middleware) and the Python handle through ``KvmeshServer``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any

from kvmesh.cluster.http_errors import DEFAULT_RETRY_AFTER_S, Overloaded, error_response

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class Admission:
    """At most ``limit`` requests admitted at once; ``None``: no limit.

    ``enter()`` admits a request or raises ``Overloaded``; every admitted request calls
    ``leave()`` exactly once. Thread-safe: Serve may call the handle's methods and the ASGI
    app from different threads.
    """

    def __init__(self, limit: int | None, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise ValueError(f"limit: must be an integer or None, got {limit!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        if not 0 < retry_after_s < float("inf"):
            raise ValueError(f"retry_after_s: must be positive and finite, got {retry_after_s}")
        self.limit, self.retry_after_s = limit, retry_after_s
        self._admitted = 0
        self._refused = 0
        self._lock = threading.Lock()

    @property
    def admitted(self) -> int:
        """Requests admitted and not yet done."""
        return self._admitted

    @property
    def refused(self) -> int:
        """Requests refused since the start."""
        return self._refused

    def enter(self) -> None:
        with self._lock:
            if self.limit is None or self._admitted < self.limit:
                self._admitted += 1
                return
            self._refused += 1
        raise Overloaded(
            f"server overloaded: {self.limit} requests are in progress, the most this server "
            f"admits; retry after {self.retry_after_s:g} s",
            self.retry_after_s,
        )

    def leave(self) -> None:
        with self._lock:
            if self._admitted <= 0:
                raise RuntimeError("Admission.leave() without a matching enter()")
            self._admitted -= 1


class AdmitRequests:
    """ASGI middleware: ``admission`` for the generation routes (``paths``, POST); the rest
    (health, metrics, models, the schema) pass untouched. The place is held while the inner
    app runs, which for a stream is until its last event was sent or its client left."""

    def __init__(
        self, app: Any, admission: Admission, paths: Collection[str] = GENERATION_PATHS
    ) -> None:
        self.app, self.admission, self.paths = app, admission, frozenset(paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in self.paths
        ):
            await self.app(scope, receive, send)
            return
        try:
            self.admission.enter()
        except Overloaded as e:
            # Refused before the body is read: the server drains or closes the connection.
            await error_response(e)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()
