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

Once a kvmesh app has answered through this proxy, a generation request that Serve itself
answers 404 (no app at the route: the app was deleted, or is being redeployed) gets a 503
with ``Retry-After`` and OpenAI's body instead (``APP_GONE``): clients and load balancers
retry a 503, where Serve's plain-text 404 read as a wrong URL. The ingress's own answers,
its 404s included, carry ``ADMISSION_HEADER`` and pass as they are.
"""

from __future__ import annotations

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


class FrontDoor(AdmitRequests):
    """``AdmitRequests`` with the limit it learns from the answers passing through: the
    ingress's ``ADMISSION_HEADER`` plus ``spare``; no limit until the first."""

    def __init__(
        self, app: Any, spare: int = SPARE, on_refuse: Callable[[], None] | None = None
    ) -> None:
        super().__init__(app, Admission(None), GENERATION_PATHS, on_refuse=on_refuse)
        self.spare = spare

    def keep(self, scope: MutableMapping[str, Any], admitted: Admitted) -> None:
        """Nothing in the scope: Serve sends the scope on to the ingress, whose own
        ``AdmitRequests`` keeps its places there."""

    def sending(self, send: Callable) -> Callable:
        replaced = False  # Serve's 404 swapped for APP_GONE: its body is dropped

        async def learning(message: dict) -> None:
            nonlocal replaced
            if message["type"] == "http.response.start":
                if self.app_gone(message):
                    replaced = True
                    return
                message = self.learn(message)
            elif replaced:
                if not message.get("more_body", False):
                    for gone in self.app_gone_messages():
                        await send(gone)
                return
            await send(message)

        return learning

    def app_gone(self, start: dict) -> bool:
        """Whether ``start`` is Serve's own 404 where a kvmesh app answered before."""
        return (
            start.get("status") == 404
            and self.admission.limit is not None
            and all(bytes(k).lower() != ADMISSION_HEADER for k, _ in start.get("headers") or [])
        )

    def app_gone_messages(self) -> list[dict]:
        """APP_GONE as a 503 with the learned Retry-After, in ASGI messages."""
        error = ApiError(503, APP_GONE, "server_error", code="unavailable")
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
