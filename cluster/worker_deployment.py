"""``WorkerDeployment``: a kvmesh worker as a replica of a Ray Serve deployment.

Serve owns the replica's life: it starts ``min`` to ``max`` replicas, routes requests to them
through kvmesh's request router, runs ``check_health``, replaces a replica that fails it or
dies, and drains one it stops (``graceful_shutdown_timeout_s``). The replica itself owns one
``WorkerActor`` (the engine, its step thread and its KV pool), created in the replica's
placement group so it sits on the same node and its resources are reserved with the replica.
The actor stays a plain Ray actor because peers call it directly (pins, releases and block
reads go to one particular worker, which a Serve handle cannot address); it is owned by the
replica, so it dies with it.

The worker's name is ``<role>-<replica id>``: stable for the replica's life, the name the
index, the router, responses and metrics use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError

from kvmesh.cluster.callers import Callers
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.cost_model import CostModel
from kvmesh.cluster.liveness import ENGINE_NAMESPACE, beating, engine_actor_name
from kvmesh.cluster.replica_logs import log_like_serve
from kvmesh.cluster.worker_request import Plan, WorkerRequest
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.kv_connector import PullPlan
from kvmesh.workers.memory_size import parse_memory
from kvmesh.workers.outputs import StreamDelta
from kvmesh.workers.worker_actor import worker_actor_class

logger = logging.getLogger(__name__)
# Longest a request waits for a peer's in-flight prefix before it computes it itself.
PENDING_WAIT_S = 60.0
READY_TIMEOUT_S = 300.0  # model load on a cold node
# Health checks in a row the engine actor left unanswered before it counts as hung.
HUNG_AFTER_SILENT_CHECKS = 2
# Engine streams beyond Serve's max_ongoing_requests: a cancelled call may not have ended
# yet (its abort awaits the step thread) when the next call comes.
STREAM_SPARE = 16


def worker_name(role: str, replica_unique_id: str) -> str:
    return f"{role}-{replica_unique_id}"


def replica_id_of(worker: str) -> str:
    """The replica's unique id in ``worker_name``'s name (roles have no dash)."""
    return worker.split("-", 1)[1]


def pull_plan(plan: Plan | None, role: str) -> PullPlan | None:
    """The part of the router's plan the worker's connector uses: where to pull the prefix
    from, and how deep (blocks of the request's chain). None when the plan cannot say, and
    then the worker looks the index up itself: no plan came (another router), or its holder
    is a worker of another role (a prefill worker, for a decode one), which the router does
    not count among its replicas and so does not size."""
    if plan is None:
        return None
    if plan.wait_for is not None:
        return PullPlan(plan.wait_for, plan.wait_blocks)
    if plan.holder is not None and plan.pull_blocks:
        return PullPlan(plan.holder, plan.local_blocks + plan.pull_blocks)
    if plan.holder is not None and not plan.holder.startswith(f"{role}-"):
        return None
    return PullPlan(None)  # nothing to pull: the prefix is here, or nowhere


def engine_config(config: ServeConfig) -> EngineConfig:
    return EngineConfig(
        model=config.model,
        block_size=config.block_size,
        kv_cache_memory=config.kv_cache_memory,
        host_cache_memory=config.host_cache_memory,
        disk_cache_dir=config.disk_cache_dir,
        disk_cache_size=config.disk_cache_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        device=config.device,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        progress=False,
    )


class WorkerDeployment:
    """The body of a worker replica; ``serve_app`` turns it into one deployment per role."""

    def __init__(self, config: dict[str, Any], role: str) -> None:
        log_like_serve()
        self.config = ServeConfig.from_dict(config)
        ctx = serve.get_replica_context()
        self.role = role
        self.name = worker_name(role, ctx.replica_id.unique_id)
        conn = (
            ClusterConnectorConfig(transport=self.config.transport)
            if self.config.connector
            else None
        )
        # Room for every call Serve may send here at once (and the few still ending after a
        # cancel): a call Ray queued would send no keep-alive, and its request would count
        # as lost on a healthy, full worker.
        streams = self.config.worker_max_ongoing_requests + STREAM_SPARE
        cls = worker_actor_class(
            self.config.num_gpus_per_worker, self.config.num_cpus_per_worker, streams
        )
        threads = max(1, int(self.config.num_cpus_per_worker))
        # Named, so an ingress that lost a call here can ask it whether it answers again.
        name = engine_actor_name(self.name)
        self.actor = cls.options(name=name, namespace=ENGINE_NAMESPACE).remote(
            self.name, engine_config(self.config), conn, threads
        )
        self.info: dict[str, Any] = ray.get(self.actor.ready.remote(), timeout=READY_TIMEOUT_S)
        self.index = get_index_actor(self.info["fingerprint"]) if self.config.connector else None
        self.cost = CostModel()
        self._host_tier = parse_memory(self.config.host_cache_memory) > 0
        self._promotions = (0, 0.0)  # its (promoted_blocks, promote_s) at the last sample
        self._stats: dict[str, Any] = {}
        self._closed = False
        # Prefixes requests here are waiting for (from a peer), by their last block's hash.
        self._arriving: dict[bytes, asyncio.Event] = {}
        self.callers = Callers(self.name, self.config.health_check_period_s)
        self._silent_checks = 0  # health checks in a row the engine left unanswered
        logger.info("worker %s ready", self.name)

    async def worker_info(self) -> dict[str, Any]:
        """The model's identity (fingerprint, namespace, sizes) and this worker's name."""
        return {**self.info, "worker_id": self.name}

    async def generate(self, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        """Run one request; yields its deltas (the last one carries the whole output), and
        an empty one each health-check period it has nothing else to send: the caller's sign
        that this replica and its engine live (``liveness``)."""
        task = self.callers.add(request.caller)
        try:
            # Closed here at a yield, ``_run``'s cleanup (cancel the engine's call) runs now.
            async with contextlib.aclosing(self._run(request)) as deltas:
                async for delta in deltas:
                    delta.worker = self.name
                    yield delta
        finally:
            self.callers.discard(request.caller, task)
            # Ray's end of this call waits, holding this replica's event loop, until the
            # caller acknowledged every delta: end it only once the caller answers.
            await self.callers.answered(request.caller)

    async def _run(self, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        beat = StreamDelta(request.request_id)
        if self.role == "prefill":
            # An empty first delta says this replica took the prompt: the ingress bounds only
            # the wait for that (``prefill_wait_s``), never the prefill itself.
            yield beat
        plan = request.plan
        if plan is not None and plan.pending_id is not None and self.index is not None:
            # The router's pending entry is believed only briefly until this worker, which
            # got the request, confirms it (a forged one never is). Nothing waits on it.
            tokens = [*request.prompt_ids, *request.resumed_ids]
            self.actor.confirm_pending.remote(plan.pending_id, tokens, request.params.cache_salt)
        period_s = self.config.health_check_period_s
        waiting = None
        if plan is not None and plan.wait_for is not None and self.index is not None:
            waiting = self._wait_for_peer(request)
        elif plan is not None and plan.local_blocks:
            waiting = self._wait_for_arrival(request.chain[: plan.local_blocks])
        if waiting is not None:
            async with contextlib.aclosing(beating(waiting, period_s, beat)) as beats:
                async for b in beats:
                    yield b
        queue = (plan.queue if plan is not None else 0) or 0
        gen = self.actor.generate_stream.remote(
            request.prompt_ids,
            request.params,
            resumed_token_ids=request.resumed_ids,
            pull_plan=pull_plan(plan, self.role),
            interval_s=request.interval_s,
            keepalive_s=period_s,
        )
        finished = False
        first = True
        try:
            async for ref in gen:
                delta: StreamDelta = await ref
                if first and self.index is not None and not delta.is_empty:
                    first = False
                    # The prompt's blocks are computed: publish them now for waiting peers
                    # (their Stored event also ends this request's pending entry). A prefill
                    # waits for it: the decode request routed next must find them in the
                    # index, or its plan names no holder and its worker pulls nothing.
                    flushed = self.actor.flush_events.remote()
                    if self.role == "prefill":
                        await flushed
                if delta.output is not None:
                    finished = True
                    self._observe(delta, queue)
                yield delta
        except RayActorError:
            # The engine actor is gone: this replica can serve nothing more. Exit, so Serve
            # stops routing here and starts a replacement (the caller migrates the request).
            logger.error("worker %s lost its engine actor; exiting the replica", self.name)
            ray.kill(ray.get_runtime_context().current_actor)
            raise
        finally:
            if not finished:
                ray.cancel(gen)
            if plan is not None and plan.pending_id is not None and self.index is not None:
                self.index.drop_pending.remote(plan.pending_id)

    async def _wait_for_peer(self, request: WorkerRequest) -> None:
        """Let a peer that is computing this prompt's prefix finish, then pull it. Requests
        routed here after this one count on the prefix being here: they wait for it too."""
        plan = request.plan
        assert plan is not None and plan.wait_for is not None and self.index is not None
        key = request.chain[plan.wait_blocks - 1]
        arrived = self._arriving.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(
                self.index.wait_stored.remote(
                    plan.wait_for, request.chain[: plan.wait_blocks], PENDING_WAIT_S
                ),
                PENDING_WAIT_S + 5,
            )
        except Exception as e:  # the index is a hint: compute what cannot be pulled
            logger.warning("%s: waiting for %s's prefix failed: %s", self.name, plan.wait_for, e)
        finally:
            arrived.set()
            if self._arriving.get(key) is arrived:
                del self._arriving[key]

    async def _wait_for_arrival(self, prefix: list[bytes]) -> None:
        """The router counted on ``prefix`` being here: if an earlier request here is still
        waiting for a peer to compute it, wait with it (else this one computes it again)."""
        blocks = set(prefix)
        for key, arrived in list(self._arriving.items()):
            if key in blocks:
                try:
                    await asyncio.wait_for(arrived.wait(), PENDING_WAIT_S + 5)
                except TimeoutError:
                    logger.warning("%s: a prefix never arrived; computing it", self.name)

    def _observe(self, delta: StreamDelta, queue: int) -> None:
        """Fold a finished request's measured TTFT and pull time into this worker's costs."""
        assert delta.output is not None
        self.cost.observe_request(delta.output.metrics, queue, self.config.block_size)

    async def check_health(self) -> None:
        """Serve's health check: fails when the actor is gone or its step thread is stuck.

        An engine actor that answers nothing for ``HUNG_AFTER_SILENT_CHECKS`` checks in a
        row is hung (its process stopped, a wedged device or driver) and is killed: its
        running requests then fail over at once (this replica exits, the ingress migrates
        them), where Serve would first drain the unhealthy replica for ``drain_timeout_s``
        while they wait on a process that will not finish them. A step thread that reports
        a stall is left to Serve's drain: a step may be slow, not lost."""
        try:
            await asyncio.wait_for(
                self.actor.health.remote(self.config.health_stall_s),
                self.config.health_check_period_s * 5,
            )
        except TimeoutError:
            self._silent_checks += 1
            if self._silent_checks >= HUNG_AFTER_SILENT_CHECKS:
                logger.error(
                    "worker %s: its engine answered no health check for %d checks in a row; "
                    "killing it, so that its requests move to other workers",
                    self.name,
                    self._silent_checks,
                )
                ray.kill(self.actor, no_restart=True)
            raise
        self._silent_checks = 0

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request router reads per replica (``RunningReplica.routing_stats``)."""
        try:
            occupancy = await asyncio.wait_for(self.actor.occupancy.remote(), 5)
        except Exception:
            occupancy = {}
        if self._host_tier:
            await self._learn_promotions()
        self._stats = {**occupancy, **self.cost.report(), "at": time.time()}
        return self._stats

    async def _learn_promotions(self) -> None:
        """Fold the host-tier blocks this worker promoted for peers' pins since the last sample
        into its ``t_host_block`` (the same copy as a load from its host tier)."""
        try:
            stats = await asyncio.wait_for(self.actor.connector_stats.remote(), 5)
        except Exception:
            return
        blocks, seconds = int(stats.get("promoted_blocks", 0)), float(stats.get("promote_s", 0))
        if blocks > self._promotions[0]:
            self.cost.observe_tier(
                "host", blocks - self._promotions[0], seconds - self._promotions[1]
            )
        self._promotions = (blocks, seconds)

    def __del__(self) -> None:
        """Serve stops this replica (scale down, redeploy, shutdown) after draining it:
        deregister from the index and free the worker."""
        if self._closed or not hasattr(self, "actor"):
            return
        self._closed = True
        try:
            ray.get(self.actor.shutdown.remote(), timeout=10)
        except Exception as e:
            logger.debug("worker %s already gone at shutdown: %s", self.name, e)
        ray.kill(self.actor)
