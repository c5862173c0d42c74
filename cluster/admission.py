"""Admission: a bound on the sequences (choices) one ingress replica holds at once.

A request is admitted when it arrives (before its body is read or parsed) with one place,
and holds its places until its answer is sent in full (the last event of a stream) or its
client left. Once parsed, a request of several choices (``n``, a batch of prompts) takes a
place for each (``Admitted.hold``), as each is a sequence the workers run: so the bound is
on what the workers will hold, whatever the requests' shapes. Past the limit a request is
refused at once, a 429 with ``Retry-After`` and OpenAI's error body (``Overloaded``): it
never waits in a queue nobody bounds, and what was admitted keeps a latency bounded by what
the workers run at once plus ``max_queued_requests`` waiting
(``ServeConfig.admission_limit``). A request of more choices than the whole limit is
admitted only while it is alone, so it can run at all.

Both entry points share one ``Admission``: the HTTP routes through ``AdmitRequests`` (ASGI
middleware, which leaves the request's ``Admitted`` in its scope for the route) and the
Python handle through ``KvmeshServer`` (a place per choice as well). Over HTTP the answers
also name the admission limit of all ingress replicas together and the Retry-After
(``ADMISSION_HEADER``), for the front door in Serve's proxy (``front_door.py``), which
refuses a flood before it reaches the ingress.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, MutableMapping
from typing import Any

from kvmesh.cluster.http_errors import DEFAULT_RETRY_AFTER_S, Overloaded, error_response

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
SCOPE_KEY = "kvmesh.admitted"  # the ASGI scope's entry for the request's ``Admitted``
# A generation answer's header: "limit=N; retry-after=S", N the sequences all ingress
# replicas admit at once, S a refusal's Retry-After (``announcement``).
ADMISSION_HEADER = b"kvmesh-admission"


class Admission:
    """At most ``limit`` places (sequences) held at once; ``None``: no limit.

    ``enter()`` admits a request with one place or raises ``Overloaded``; ``grow`` gives an
    admitted request more; every admitted request gives all its places back with one
    ``leave(places)``. Thread-safe: Serve may call the handle's methods and the ASGI app
    from different threads.
    """

    def __init__(self, limit: int | None, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        self.limit: int | None = None
        self.retry_after_s = DEFAULT_RETRY_AFTER_S
        self.resize(limit, retry_after_s)
        self._admitted = 0
        self._refused = 0
        self._lock = threading.Lock()

    def resize(self, limit: int | None, retry_after_s: float | None = None) -> None:
        """A new limit (and Retry-After) from now on; what is admitted stays admitted, and a
        smaller limit only refuses more until enough of it left."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise ValueError(f"limit: must be an integer or None, got {limit!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        if retry_after_s is not None and not 0 < retry_after_s < float("inf"):
            raise ValueError(f"retry_after_s: must be positive and finite, got {retry_after_s}")
        self.limit = limit
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    @property
    def admitted(self) -> int:
        """Places held now: the sequences of the requests admitted and not yet done."""
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

    def grow(self, held: int, more: int) -> None:
        """An admitted request that holds ``held`` places takes ``more``, or raises
        ``Overloaded`` (and keeps what it held). Past the limit it still may when it is the
        only request in (it holds every place taken): a request larger than the limit runs
        alone instead of never."""
        if more <= 0:
            return
        with self._lock:
            alone = self._admitted == held
            if self.limit is None or self._admitted + more <= self.limit or alone:
                self._admitted += more
                return
            self._refused += 1
            free = self.limit - self._admitted
        raise Overloaded(
            f"server overloaded: this request's {held + more} choices need {more} more "
            f"places than the {max(free, 0)} free of the {self.limit} this server admits; "
            f"retry after {self.retry_after_s:g} s",
            self.retry_after_s,
        )

    def leave(self, places: int = 1) -> None:
        with self._lock:
            if not 0 < places <= self._admitted:
                raise RuntimeError("Admission.leave() gives back more than was entered")
            self._admitted -= places

    def admit(self, choices: int = 1) -> Admitted:
        """A request holding a place per choice, or ``Overloaded`` (holding none); used as
        a context manager, which gives every place back."""
        self.enter()
        admitted = Admitted(self)
        try:
            admitted.hold(choices)
        except Overloaded:
            self.leave()
            raise
        return admitted


class Admitted:
    """One admitted request's places: one from ``enter()``, then one per choice. A context
    manager: leaving it gives them all back."""

    def __init__(self, admission: Admission) -> None:
        self.admission, self.places = admission, 1

    def hold(self, choices: int) -> None:
        """Hold a place for each of ``choices`` (a count, not an increment), or raise
        ``Overloaded``."""
        self.admission.grow(self.places, choices - self.places)
        self.places = max(self.places, choices)

    def __enter__(self) -> Admitted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.admission.leave(self.places)


def hold_places(scope: MutableMapping[str, Any], choices: int) -> None:
    """The request in ``scope`` holds a place per choice (``Overloaded`` when they do not
    fit); a no-op without admission."""
    admitted = scope.get(SCOPE_KEY)
    if admitted is not None:
        admitted.hold(choices)


class AdmitRequests:
    """ASGI middleware: ``admission`` for the generation routes (``paths``, POST); the rest
    (health, metrics, models, the schema) pass untouched. The places are held while the inner
    app runs, which for a stream is until its last event was sent or its client left; the
    route finds the request's ``Admitted`` under ``SCOPE_KEY`` (see ``hold_places``). With
    ``announce``, every generation answer, refusals included, names it and the Retry-After
    in ``ADMISSION_HEADER``; ``on_refuse`` is called for each refusal (a metric)."""

    def __init__(
        self,
        app: Any,
        admission: Admission,
        paths: Collection[str] = GENERATION_PATHS,
        announce: int | None = None,
        on_refuse: Callable[[], None] | None = None,
    ) -> None:
        self.app, self.admission, self.paths = app, admission, frozenset(paths)
        # Built once: the ingress's limit and Retry-After do not change while it runs.
        self.header = (
            None
            if announce is None
            else (ADMISSION_HEADER, announcement(announce, admission.retry_after_s))
        )
        self.on_refuse = on_refuse

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in self.paths
        ):
            await self.app(scope, receive, send)
            return
        send = self.sending(send)
        try:
            admitted = self.admission.admit()
        except Overloaded as e:
            if self.on_refuse is not None:
                self.on_refuse()
            # Refused before the body is read: the server drains or closes the connection.
            await error_response(e)(scope, receive, send)
            return
        self.keep(scope, admitted)
        with admitted:
            await self.forward(scope, receive, send)

    async def forward(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Run the inner app for an admitted generation request."""
        await self.app(scope, receive, send)

    def keep(self, scope: MutableMapping[str, Any], admitted: Admitted) -> None:
        """Where the route finds its request's places (``hold_places``)."""
        scope[SCOPE_KEY] = admitted

    def sending(self, send: Callable) -> Callable:
        """``send`` for one generation request: it adds ``ADMISSION_HEADER`` when announcing."""
        header = self.header
        if header is None:
            return send

        async def announcing(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        return announcing


def announcement(limit: int, retry_after_s: float) -> bytes:
    """``ADMISSION_HEADER``'s value."""
    return f"limit={limit}; retry-after={retry_after_s:g}".encode()


def parse_announcement(value: bytes) -> tuple[int, float] | None:
    """``announcement``'s (limit, Retry-After in seconds); None unless both are there and
    positive (finite)."""
    fields: dict[str, str] = {}
    for part in bytes(value).decode("latin-1").split(";"):
        key, _, given = part.partition("=")
        fields[key.strip()] = given.strip()
    try:
        limit, retry_after_s = int(fields["limit"]), float(fields["retry-after"])
    except (KeyError, ValueError):
        return None
    return (limit, retry_after_s) if limit > 0 and 0 < retry_after_s < float("inf") else None
