"""The Ray Serve application: worker deployments behind kvmesh's request router, and a
stateless ingress in front of them.

- HTTP: the OpenAI routes of ``openai_api.build_api`` over ``ClusterBackend``.
- Python: ``handle.chat.remote(body)`` and ``handle.completions.remote(body)`` take the HTTP
  routes' JSON body as a dict and answer their JSON (``n``, prompt batches, logprobs, the
  same checks); ``handle.generate.remote(request)`` is the plain form: one ``prompt`` (text
  or token ids) or ``messages`` plus sampling fields, answered with text, token ids and
  provenance (``handle_generate.py``). With ``"stream": True`` in the body *and*
  ``handle.options(stream=True)`` each yields chunks.
- ``build_app(args)`` is the Serve ``import_path`` target (serveConfigV2, KubeRay), and
  ``deploy(config)`` runs it from Python and returns the ingress's handle: Serve's, wrapped
  in ``IngressHandle`` so that a request its ingress replica lost is sent again.

Queues are bounded end to end. Each ingress replica admits at most
``config.admission_limit`` sequences at once, one per choice (HTTP and handle alike); over HTTP the
rest get a 429 with ``Retry-After`` and OpenAI's error body, over the handle Serve's
``BackPressureError``. Behind it, Serve's ``max_queued_requests`` on each worker deployment
(``admission_limit`` as well, a backstop; its ``BackPressureError`` is a 429 too) bounds what
waits at a caller for a worker replica; in front of it, Serve's proxy queues at most
``INGRESS_SPARE_SLOTS`` requests for an ingress slot (past that, Serve's own plain-text 429),
and before that the front door in the proxy (``front_door.py``) refuses what is past all
ingress replicas' limit without a hop to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.schema import ApplicationStatus

from kvmesh.cluster import front_door
from kvmesh.cluster.admission import Admission, Admitted
from kvmesh.cluster.api_error import BadRequest, checked
from kvmesh.cluster.backend import GenerateRequest
from kvmesh.cluster.config import ServeConfig, with_env_api_key
from kvmesh.cluster.frontend import ClusterBackend
from kvmesh.cluster.generation import Generation
from kvmesh.cluster.handle_generate import chunk_dict, completion_dict, parse_request
from kvmesh.cluster.http_errors import OVERLOADED_STATUS, Overloaded
from kvmesh.cluster.ingress_handle import IngressHandle
from kvmesh.cluster.launch import check_serve_http, serve_details
from kvmesh.cluster.liveness import SILENT_PERIODS
from kvmesh.cluster.metrics import ServeMetrics
from kvmesh.cluster.openai_requests import chat_choices, completion_choices
from kvmesh.cluster.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.cluster.replica_logs import log_like_serve
from kvmesh.cluster.request_parsing import B, parse_dict
from kvmesh.cluster.response_shape import ResponseShape
from kvmesh.cluster.tls import check_tls_files
from kvmesh.cluster.worker_deployment import WorkerDeployment

logger = logging.getLogger(__name__)
APP_NAME = "kvmesh"
INGRESS_DEPLOYMENT = "KvmeshServer"
WORKER_DEPLOYMENT_PREFIX = "kvmesh-"
# Ingress slots beyond the admitted requests: refusals (answered at once) and the cheap routes
# (/health, /metrics, /v1/models) need them under overload; Serve's proxy queues at most as
# many again for a slot.
INGRESS_SPARE_SLOTS = 256
# How often an ingress replica checks whether its app is being deleted, and how much longer
# than the drain Serve gives it before killing it: time to end what still runs, cleanly.
APP_WATCH_S = 1.0
INGRESS_STOP_MARGIN_S = APP_WATCH_S + 4.0
# Serve autoscaling: how often each handle (an ingress replica's) reports its ongoing
# requests to Serve's controller, and the window the controller averages them over. Serve's
# defaults (10 s, 30 s) left a burst up to 10 s unseen before upscale_delay_s even began
# (BENCHMARKS.md, Autoscaling). `metrics_interval_s` is deprecated in Ray 2.60 for an
# environment variable, which would have to reach every process holding a handle; it is
# still the deployment's own setting, and Serve wants the window longer than it.
METRICS_INTERVAL_S = 1.0
LOOK_BACK_S = 5.0


@serve.ingress()
class KvmeshServer:
    """The ingress: stateless, so it may have several replicas (``ingress_replicas``)."""

    def __init__(self, config: dict[str, Any], workers: dict[str, Any]) -> None:
        log_like_serve()
        self.config = ServeConfig.from_dict(config)
        self.backend = ClusterBackend(self.config, workers)
        self.admission = Admission(self.config.admission_limit, self.config.retry_after_s)
        self.metrics = ServeMetrics()  # its latency histograms count handle requests too
        self.generation = Generation(self.backend, self.metrics)
        app = serve.get_replica_context().app_name
        threading.Thread(
            target=self._drain_when_deleted, args=(app,), name="kvmesh-app-watch", daemon=True
        ).start()

    def _drain_when_deleted(self, app: str) -> None:
        """Drain (``ClusterBackend.drain``) once Serve deletes the app: ``kvmesh serve``'s
        stop, ``serve delete``, a RayService update. Serve tells a replica nothing before it
        kills it (after ``graceful_shutdown_timeout_s``), so this asks for the app's status
        every ``APP_WATCH_S``."""
        while True:
            time.sleep(APP_WATCH_S)
            try:
                status = serve.status().applications.get(app)
            except Exception:  # the controller restarting: ask again
                continue
            if status is None or status.status == ApplicationStatus.DELETING:
                logger.info(
                    "the app is being deleted: draining for %.1f s", self.config.drain_timeout_s
                )
                self.backend.drain(self.config.drain_timeout_s)
                return

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's user_config carries only ``owner``, who deployed the app: ``kvmesh serve``
        reads it back from Serve (``launch.app_owner``); the replica needs nothing from it,
        but Serve wants this method wherever a user_config is set."""

    def __serve_build_asgi_app__(self) -> Any:
        from kvmesh.cluster.openai_api import build_api

        return build_api(
            self.backend,
            model_name=self.config.model_name,
            api_key=self.config.api_key,
            metrics=self.metrics,
            max_request_bytes=self.config.max_request_bytes,
            admission=self.admission,
            announce_limit=self.config.cluster_admission_limit,
        )

    async def chat(self, body: dict[str, Any]) -> Any:
        """OpenAI's chat completion: ``body`` is what the HTTP route's JSON body holds, the
        answer its JSON response as a dict; with ``"stream": true`` (and
        ``handle.options(stream=True)``) its chunks, as dicts. Errors as over HTTP, raised:
        ``ApiError`` (``status``, OpenAI's ``body``); over the admission limit Serve's
        ``BackPressureError``."""
        return await self._openai(body, ChatCompletionRequest, chat_choices)

    async def completions(self, body: dict[str, Any]) -> Any:
        """OpenAI's (text) completions, ``n`` and prompt batches included; as ``chat``."""
        return await self._openai(body, CompletionRequest, completion_choices)

    async def _openai(self, body: dict[str, Any], model: type[B], choices: Any) -> Any:
        received = time.perf_counter()
        # One place before any parsing, as over HTTP (refused before its body is read): a
        # flood of calls past the limit costs this replica no validating or tokenizing.
        with self._admitted() as admitted:
            parsed = await asyncio.to_thread(parse_dict, body, model)
            reqs, shape = await choices(self.backend, parsed, self.config.model_name)
            if not parsed.stream:
                admitted.hold(len(reqs))
                return await self.generation.answer(reqs, shape, received)
        return self._openai_stream(reqs, shape, parsed.include_usage, received)

    async def _openai_stream(
        self, reqs: list[GenerateRequest], shape: ResponseShape, usage: bool, received: float
    ) -> AsyncIterator[dict[str, Any]]:
        with self._admitted(len(reqs)):  # at the first chunk asked for, as ``_stream``
            opened = await self.generation.open(reqs, shape)
            # Closed with this generator (the caller stopped reading): aborts the choices.
            async with contextlib.aclosing(
                self.generation.chunks(opened, shape, usage, received)
            ) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def generate(self, request: dict[str, Any]) -> Any:
        """The Python handle's entry point; see the module docstring. A bad request (here or
        in the backend: a prompt longer than the context, ...) raises ``BadRequest`` (a
        ValueError naming the field, and a 400 ``ApiError``); over the admission limit
        Serve's ``BackPressureError`` (429, ``retry_after_s``)."""
        with checked(BadRequest):
            req = parse_request(request)
        if request.get("stream"):
            return self._stream(req)
        with self._admitted(), checked(BadRequest):
            return completion_dict(await self.backend.generate(req))

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        # Admitted at the first chunk asked for, inside the generator, which gives the places
        # back however it ends; a generator never started (a call without
        # ``options(stream=True)``, which Serve refuses) holds none.
        with self._admitted(), checked(BadRequest):
            async with contextlib.aclosing(self.backend.stream(req)) as chunks:
                async for chunk in chunks:
                    yield chunk_dict(chunk)

    @contextlib.contextmanager
    def _admitted(self, choices: int = 1) -> Iterator[Admitted]:
        """A place per choice held while inside; Serve's ``BackPressureError`` for an
        ``Overloaded`` raised at entry, by a ``hold`` inside, or by the workers' queue."""
        try:
            with self.admission.admit(choices) as admitted:
                yield admitted
        except Overloaded as e:
            raise BackPressureError(
                num_queued_requests=self.admission.admitted,
                max_queued_requests=self.admission.limit or 0,
                status_code=OVERLOADED_STATUS,
                retry_after_s=e.retry_after,
            ) from None

    async def stats(self) -> dict[str, Any]:
        return await self.backend.stats()

    async def ingress_stats(self) -> dict[str, Any]:
        """This replica's admission (limit, admitted now, refused so far) and process (pid,
        resident memory): for benchmarks and operators."""
        import psutil

        return {
            "limit": self.admission.limit,
            "admitted": self.admission.admitted,
            "refused": self.admission.refused,
            "pid": os.getpid(),
            "rss_bytes": psutil.Process().memory_info().rss,
        }


def _worker_deployment(config: ServeConfig, role: str, count: int, most: int | None) -> Any:
    """One role's worker deployment: a fixed count, or autoscaling between count and most."""
    from ray.serve.config import RequestRouterConfig

    from kvmesh.cluster.request_router import KvAwareRequestRouter, RoundRobinRequestRouter

    routers: dict[str, Any] = {
        "kv_aware": KvAwareRequestRouter,
        "round_robin": RoundRobinRequestRouter,
    }
    options: dict[str, Any] = {
        "name": f"{WORKER_DEPLOYMENT_PREFIX}{role}",
        "max_ongoing_requests": config.worker_max_ongoing_requests,
        # Requests at one caller (an ingress replica's handle) not yet assigned a replica of
        # this role; Serve refuses more with a BackPressureError, which the ingress answers
        # 429. Serve counts a request as queued while its router is still choosing, so the
        # bound is all that one ingress replica admits: a backstop that never refuses what
        # admission let in.
        "max_queued_requests": config.admission_limit,
        "backpressure_config": _backpressure(config),
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": config.health_check_period_s * 10,
        "graceful_shutdown_timeout_s": config.drain_timeout_s,
        # The replica is a thin proxy; its engine actor takes the worker's resources from
        # this bundle, so Serve reserves them with the replica (and the autoscaler sees them).
        "ray_actor_options": {"num_cpus": 0},
        "placement_group_bundles": [_worker_bundle(config)],
    }
    if most is None:
        options["num_replicas"] = count
    else:
        options["autoscaling_config"] = {
            "min_replicas": count,
            "max_replicas": most,
            "initial_replicas": count,
            "target_ongoing_requests": config.target_ongoing_requests,
            "upscale_delay_s": 2.0,
            "downscale_delay_s": config.downscale_delay_s,
            # A 30-s average (Serve's default window) would hold a burst's workers back for
            # most of the burst, and keep them that long after it, whatever the two delays
            # say; a 10-s report interval would add up to 10 s to each.
            "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": LOOK_BACK_S,
        }
    if config.router in routers:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=routers[config.router],
            request_router_kwargs={
                "role": role,
                "block_size": config.block_size,
                "connector": config.connector,
            }
            if config.router == "kv_aware"
            else {},
            request_routing_stats_period_s=1.0,
            request_routing_stats_timeout_s=5.0,
        )
    return serve.deployment(WorkerDeployment).options(**options).bind(config.to_dict(), role)


def _worker_bundle(config: ServeConfig) -> dict[str, float]:
    import ray

    gpus = config.num_gpus_per_worker
    if gpus is None:
        gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) else 0
    bundle = {**config.worker_resources, "CPU": config.num_cpus_per_worker}
    if gpus:
        bundle["GPU"] = gpus
    return bundle


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for ``args`` (ServeConfig fields), a Serve ``import_path``
    (a RayService's serveConfigV2): its API key, when the args name none, from
    ``KVMESH_API_KEY`` in the environment (a Secret in the pods)."""
    return application(ServeConfig.from_dict(with_env_api_key(dict(args or {}))))


def application(config: ServeConfig, owner: str | None = None) -> serve.Application:
    """The Serve application for ``config``, as given (``deploy``'s; the CLI has read
    ``KVMESH_API_KEY`` into it already).

    Deployments: ``kvmesh-worker`` (or ``kvmesh-prefill`` + ``kvmesh-decode``) and the
    ingress ``KvmeshServer``. ``owner`` names who deploys it (in the ingress's user_config,
    where ``serve status`` and a later ``kvmesh serve`` read it).
    """
    workers = {role: _worker_deployment(config, role, c, m) for role, c, m in config.roles}
    ingress = serve.deployment(
        KvmeshServer,
        name=INGRESS_DEPLOYMENT,
        num_replicas=config.ingress_replicas,
        # Admission refuses past admission_limit itself (OpenAI's body); Serve's own bounds
        # sit above it so that they never refuse first.
        max_ongoing_requests=config.admission_limit + INGRESS_SPARE_SLOTS,
        max_queued_requests=INGRESS_SPARE_SLOTS,
        backpressure_config=_backpressure(config),
        graceful_shutdown_timeout_s=config.drain_timeout_s + INGRESS_STOP_MARGIN_S,
        # Serve's proxy sends a hung ingress replica (a stopped process, a cut-off node) its
        # share of new requests, each to hang, until three health checks in a row fail: ~90 s
        # with Serve's default check (every 10 s, a 30-s timeout). The workers' period and a
        # timeout of SILENT_PERIODS periods, as for a worker call, make it ~3 x 10 s. The
        # check runs on the replica's event loop: 10 s is long enough for a busy one (the
        # overload row at 4x marked no ingress unhealthy), not for one held that long.
        health_check_period_s=config.health_check_period_s,
        health_check_timeout_s=config.health_check_period_s * SILENT_PERIODS,
        # The workers need the cores.
        ray_actor_options={"num_cpus": 0, "resources": dict(config.ingress_resources)},
    )
    if owner is not None:
        ingress = ingress.options(user_config={"owner": owner})
    return ingress.bind(config.to_dict(), workers)


def _backpressure(config: ServeConfig) -> BackpressureConfig:
    """Serve's answer past a deployment's max_queued_requests: the admission's status and
    Retry-After."""
    return BackpressureConfig(status_code=OVERLOADED_STATUS, retry_after_s=config.retry_after_s)


# Serve's controller checks each HTTP proxy this often (Serve's default: 10 s) and replaces
# one after 3 failed checks in a row: a killed proxy refused connections for ~27 s, ~6-6.5 s
# at 2 s, ~4-4.5 s at 1 s (BENCHMARKS.md, Failover; bench/serve_plane.py). A check is one
# cheap actor call, and a busy proxy still has the check's own timeout (10 s) to answer: the
# period only sets how soon a dead one is found.
PROXY_HEALTH_ENV = "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S"
PROXY_HEALTH_CHECK_PERIOD_S = "1"


# A replica that failed its health checks is killed at once, not drained: a worker's callers
# moved its requests after ``SILENT_PERIODS`` of silence, and a hung replica ends none, so a
# drain only delays its replacement (whose resources it holds) by ``drain_timeout_s``.
FORCE_STOP_ENV = "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS"


def controller_env() -> dict[str, str]:
    """Serve's controller's settings kvmesh starts it with, besides the front door's; an
    operator's own value in this process's environment wins."""
    defaults = {PROXY_HEALTH_ENV: PROXY_HEALTH_CHECK_PERIOD_S, FORCE_STOP_ENV: "1"}
    return {name: os.environ.get(name, value) for name, value in defaults.items()}


def deploy(config: ServeConfig, owner: str | None = None) -> IngressHandle:
    """Run the app on the connected Ray cluster (HTTP, or HTTPS with ``ssl_*``, on
    config.host:config.port) and return its handle (Serve's, sending a request its ingress
    replica lost again: ``ingress_handle.py``). Call ``ray.init`` first, or this
    joins/starts one as Serve does. Serve, when this starts it, gets kvmesh's front door in
    its proxies (``front_door.py``). Raises ValueError for TLS files that do not load, and
    ``launch.ClusterTaken`` when Serve already runs with another address or TLS setup (it
    would ignore ours)."""
    check_tls_files(config)
    door = front_door.controller_env()
    serve.start(
        http_options=config.http_options,
        controller_options={"runtime_env": {"env_vars": {**controller_env(), **door}}},
    )
    check_serve_http(config, serve_details())
    if door:
        front_door.warn_if_missing()
    return IngressHandle(serve.run(application(config, owner), name=APP_NAME, route_prefix="/"))


def app_handle() -> IngressHandle:
    """The handle of the kvmesh app already running on the connected Ray cluster (started by
    ``kvmesh serve``, a serve config or KubeRay), as ``deploy`` returns it. Call
    ``ray.init(address=...)`` first; raises Serve's ``RayServeException`` when no app runs."""
    return IngressHandle(serve.get_app_handle(APP_NAME))
