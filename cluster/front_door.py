"""The front door: admission in Serve's HTTP proxy, before a refusal costs a hop to the ingress.

Every request the ingress refuses has still cost Serve's proxy an actor call and the ingress
replica a request: about 6 ms of CPU each, measured on two cores at 200 req/s. When a flood
arrives faster than the two can refuse it, a line forms in front of Serve's own bounds, and
every answer waits in it, admitted or refused (35 s p99 for both in that run, growing with
the flood; BENCHMARKS.md, Overload). The front door is ASGI middleware in the proxy: once
this proxy holds as many generation requests as all ingress replicas admit together, plus
``SPARE``, it answers the next ones itself, with the ingress's 429, ``Retry-After`` and
OpenAI's body; those the ingress would have refused anyway. (Requests count once here and
once per choice at the ingress, so the door never refuses what the ingress would admit.)

It needs no settings of its own: every generation answer from the ingress names the limit
and the Retry-After in ``admission.ADMISSION_HEADER``, which the door reads, and removes; a
redeployed app with other settings corrects them with its first answer. Until an answer has
named them, the door admits everything. The ``SPARE``
covers the answers on their way back: a request the ingress has finished still counts here
until its last bytes passed.

Serve builds a proxy's middleware from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in the
proxy's environment, so the door is there when Serve's controller started with ``CALLBACK``
in its ``runtime_env`` (``controller_env``): ``serve_app.deploy`` starts it so, and the
RayService manifest's serveConfigV2 sets it in ``controller_options``. A proxy started
otherwise has no door; the ingress still refuses, at the cost above, and ``deploy`` says so
(``warn_if_missing``) when it finds Serve already running without it.

A generation request that Serve itself answers 404 (no app at the route: the app was
deleted, is being redeployed, or this proxy was just restarted and has not learned the
routes yet) gets a 503 with ``Retry-After`` and OpenAI's body instead (``APP_GONE``):
clients and load balancers retry a 503, where Serve's plain-text 404 read as a wrong URL.
The ingress's own answers, its 404s included, carry ``ADMISSION_HEADER`` and pass as they
are.

An ingress replica lost while it held a request (its process killed, its node gone) makes
Serve's proxy send nothing, and its HTTP server then answers 500 (or cuts a stream). The
door sends a request Serve lost before any answer again, its body replayed, up to
``RETRIES`` times: Serve's router has dropped the dead replica, so a try reaches another
ingress replica or waits for the replacement. One that still has no answer gets a 503
(``LOST``) with ``Retry-After`` and OpenAI's body. A stream cut after it started ends with
OpenAI's error event and ``[DONE]``, not a reset connection. A request whose client left
is not tried again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from kvmesh.cluster.admission import (
    ADMISSION_HEADER,
    GENERATION_PATHS,
    Admission,
    AdmitRequests,
    Admitted,
    parse_announcement,
)
from kvmesh.cluster.api_error import ApiError

logger = logging.getLogger(__name__)
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "kvmesh.cluster.front_door:middlewares"
SPARE = 8  # measured: enough for the answers in transit at 200 req/s (BENCHMARKS.md)
APP_GONE = (
    "no kvmesh app serves this route now (it is stopping or being redeployed); retry "
    "shortly, or on another server"
)
LOST = "the server answering this request was lost; retry it"
# How often a request Serve lost before any answer is sent again, and the pause before each:
# Serve's router drops a dead replica at its first failed call, so the next try finds a live
# one, or waits in Serve's queue for the replacement.
RETRIES = 2
RETRY_PAUSE_S = 0.2
# kvmesh's other routes, which change nothing: a request Serve lost there is sent again too
# (no admission; Serve's 404 passes as it is, as the ingress's own 404s there carry no
# ``ADMISSION_HEADER`` to tell them apart).
SAFE_PATHS = frozenset(
    {"/health", "/metrics", "/v1/models", "/tokenize", "/detokenize", "/openapi.json", "/docs"}
)


class FrontDoor(AdmitRequests):
    """``AdmitRequests`` with the limit it learns from the answers passing through: the
    ingress's ``ADMISSION_HEADER`` plus ``spare``; no limit until the first. Each admitted
    request, and each to ``SAFE_PATHS``, is sent on as an ``Answer``: tried again while
    Serve lost it before any answer (``RETRIES``), and never left as a 500, a cut stream, or
    (generation) Serve's 404."""

    def __init__(
        self, app: Any, spare: int = SPARE, on_refuse: Callable[[], None] | None = None
    ) -> None:
        super().__init__(app, Admission(None), GENERATION_PATHS, on_refuse=on_refuse)
        self.spare = spare

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path in SAFE_PATHS or path.startswith("/v1/models/")):
            await self.forward(scope, receive, send, generation=False)
            return
        await super().__call__(scope, receive, send)

    def keep(self, scope: MutableMapping[str, Any], admitted: Admitted) -> None:
        """Nothing in the scope: Serve sends the scope on to the ingress, whose own
        ``AdmitRequests`` keeps its places there."""

    async def forward(
        self, scope: dict, receive: Callable, send: Callable, generation: bool = True
    ) -> None:
        body = Replay(receive)
        for tries_left in range(RETRIES, -1, -1):
            answer = Answer(self, send, body, app_gone=generation)
            try:
                await self.app(scope, body.reader(), answer.send)
            except Exception:  # Serve's proxy lost the request: tried again below
                logger.debug("Serve's proxy raised for a request", exc_info=True)
            if answer.complete or body.client_left:
                return
            if answer.started:  # a stream cut by its ingress's loss: end it with an error
                await send(answer.lost_stream_end())
                return
            if tries_left:
                await asyncio.sleep(RETRY_PAUSE_S)
        logger.warning("a request was lost %d times on its way: answered 503", RETRIES + 1)
        for message in self.unavailable(LOST):
            await send(message)

    def app_gone(self, start: dict) -> bool:
        """Whether ``start`` is Serve's own 404 (no app at the route): the door runs only in
        proxies of a Serve that kvmesh started, so the app is deleted, being redeployed, or
        not yet known to this proxy (a proxy that Serve just restarted answers 404 until it
        learns the routes)."""
        return start.get("status") == 404 and not _announced(start)

    def unavailable(self, message: str) -> list[dict]:
        """``message`` as a 503 with the learned Retry-After and OpenAI's body, in ASGI
        messages."""
        error = unavailable_error(message)
        retry_after = str(max(1, math.ceil(self.admission.retry_after_s)))
        response = JSONResponse(error.body, 503, headers={"Retry-After": retry_after})
        return [
            {"type": "http.response.start", "status": 503, "headers": response.raw_headers},
            {"type": "http.response.body", "body": response.body},
        ]

    def learn(self, start: dict) -> dict:
        """The ``http.response.start`` message ``start`` without ``ADMISSION_HEADER``, after
        taking the limit and Retry-After it names."""
        headers = start.get("headers") or []
        kept = [(k, v) for k, v in headers if bytes(k).lower() != ADMISSION_HEADER]
        if len(kept) == len(headers):
            return start  # not the ingress's answer: the door's own refusal, or Serve's
        for name, value in headers:
            if bytes(name).lower() == ADMISSION_HEADER and (named := parse_announcement(value)):
                limit, retry_after_s = named
                self.admission.resize(limit + self.spare, retry_after_s)
        return {**start, "headers": kept}


def unavailable_error(message: str) -> ApiError:
    """``message`` as the 503 a request lost on its way gets, with OpenAI's body."""
    return ApiError(503, message, "server_error", code="unavailable")


def _announced(start: dict) -> bool:
    """Whether an ``http.response.start`` is the ingress's answer (it names the admission)."""
    return any(bytes(k).lower() == ADMISSION_HEADER for k, _ in start.get("headers") or [])


class Replay:
    """A request's ``receive`` that keeps its body, so that each try reads it whole again;
    and whether its client left (then no try follows)."""

    def __init__(self, receive: Callable) -> None:
        self._receive = receive
        self._body: list[dict] | None = []  # None once released
        self.client_left = False

    def release(self) -> None:
        """No try follows (an answer started): the body need not be kept."""
        self._body = None

    def reader(self) -> Callable:
        """A ``receive`` for one try: the body read so far, then the client's own."""
        read = 0

        async def receive() -> dict:
            nonlocal read
            if self._body is not None and read < len(self._body):
                read += 1
                return self._body[read - 1]
            message = await self._receive()
            if message["type"] == "http.request" and self._body is not None:
                self._body.append(message)
                read += 1
            elif message["type"] == "http.disconnect":
                self.client_left = True
            return message

        return receive


class Answer:
    """One try's answer on its way to the client, passed on as it comes. A try Serve lost
    before it started a response (its ingress replica died: Serve's proxy then sends
    nothing, and its server a 500) leaves ``started`` false, to try again. Serve's own 404
    is replaced by ``APP_GONE``; the ingress's answers lose ``ADMISSION_HEADER`` after the
    door learned from it."""

    def __init__(self, door: FrontDoor, send: Callable, body: Replay, app_gone: bool) -> None:
        self.door, self._send, self._body, self._app_gone = door, send, body, app_gone
        self.started = self.complete = False
        self._replaced = False  # Serve's 404 swapped for APP_GONE: its body is dropped
        self._headers: list[Any] = []  # the response's, read only if it is cut

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self._body.release()
            if self._app_gone and self.door.app_gone(message):
                self._replaced = True
                return
            message = self.door.learn(message)
            self._headers = message.get("headers") or []
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
            if self._replaced:
                for gone in self.door.unavailable(APP_GONE):
                    await self._send(gone)
                return
        if self._replaced:
            return
        await self._send(message)

    def lost_stream_end(self) -> dict:
        """The last body message of a response cut after it started: for a stream, OpenAI's
        error event and ``[DONE]``, as an error after the first event goes (never a reset
        connection)."""
        types = [bytes(v) for k, v in self._headers if bytes(k).lower() == b"content-type"]
        end = b""
        if types and types[0].startswith(b"text/event-stream"):
            end = b"data: " + json.dumps(unavailable_error(LOST).body).encode()
            end += b"\n\ndata: [DONE]\n\n"
        return {"type": "http.response.body", "body": end, "more_body": False}


def middlewares() -> list[Any]:
    """Serve's proxy callback (``CALLBACK``): the front door, and the Ray metric that counts
    its refusals (Serve's own proxy metrics never see them)."""
    from ray.util.metrics import Counter
    from starlette.middleware import Middleware

    refused = Counter(
        "kvmesh_front_door_refused",
        description="Generation requests refused 429 by the front door in Serve's proxy.",
    )
    return [Middleware(FrontDoor, on_refuse=refused.inc)]


def controller_env() -> dict[str, str]:
    """The ``env_vars`` for Serve's controller (which its proxies inherit) that install the
    door; nothing when this process's environment names another callback already (that
    callback may return ``middlewares()`` with its own)."""
    if os.environ.get(CALLBACK_ENV, CALLBACK) != CALLBACK:
        logger.warning(
            "%s is set to %s: Serve's proxies get that instead of kvmesh's front door",
            CALLBACK_ENV,
            os.environ[CALLBACK_ENV],
        )
        return {}
    return {CALLBACK_ENV: CALLBACK}


def installed(controller: Any) -> bool:
    """Whether the process of Ray actor ``controller`` (Serve's controller, whose
    environment its proxies get) names the door's callback."""
    import ray

    env = controller.__ray_call__.remote(lambda _: os.environ.get(CALLBACK_ENV))
    return ray.get(env, timeout=30) == CALLBACK


def warn_if_missing(controller: Any = None) -> bool:
    """After ``serve.start``: warn, and True, when the running Serve (``controller``: its
    controller actor, by default looked up) has no door: someone started it before
    ``deploy`` did, and ``serve.start`` leaves a running Serve as it is."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        if controller is None:
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        if installed(controller):
            return False
    except Exception as e:  # a question for a warning must never fail a deploy
        logger.debug("could not ask Serve's controller about the front door: %s", e)
        return False
    logger.warning(
        "Serve was already running, started without kvmesh's front door: a flood past the "
        "admission limit costs a hop to the ingress for every refusal (docs/design.md, "
        "Overload). Shut Serve down first (`serve shutdown`), or start it with "
        "controller_options={'runtime_env': {'env_vars': {'%s': '%s'}}}",
        CALLBACK_ENV,
        CALLBACK,
    )
    return True
