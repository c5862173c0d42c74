"""kvmesh's routing policies as Ray Serve request routers, set on the worker deployments.

``KvAwareRequestRouter`` runs the cost model of ``router.py`` (docs/router.md) inside Serve's
routing loop: for each request it reads the block-hash chain the ingress computed, asks the
index which worker holds or is computing how much of it (one ``route_lookup``), takes each
replica's queue length from Serve's own cache and the costs each replica measured and reports
(``record_routing_stats``), and ranks the replicas, each at its own costs. Its decision
travels to the worker as the request's ``Plan``, and the prompt is recorded in the index as a
pending entry, so every ingress replica (each has its own router) sees what is being
computed where.

If the index is down, routing falls back to load only; nothing fails because of it. A call
that fails or times out (a dead index fails at once; a hung one, say a stopped process, only
after ``INDEX_TIMEOUT_S``) marks the index down: requests then route by load without asking
it, while one probe at a time, in the background, asks it again every ``INDEX_RETRY_S`` and
marks it up when it answers. So a hung index costs one timeout once (for the request that
met it, and those decided after it, one at a time), not one timeout per request.
``RoundRobinRequestRouter`` is the baseline; ``least_loaded`` is Serve's own power-of-two
router.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvmesh.cluster.router import Router, WorkerView
from kvmesh.cluster.worker_deployment import replica_id_of, worker_name
from kvmesh.cluster.worker_request import Plan, WorkerRequest
from kvmesh.connector.holder_sets import pullable_depths
from kvmesh.connector.index_actor import get_index_actor

logger = logging.getLogger(__name__)
PENDING_TTL_S = 30.0  # a pending entry outlives a lost drop call by at most this long
INDEX_TIMEOUT_S = 2.0
MAX_RACES = 3  # fresh decisions after racing another router, before deciding without a claim
INDEX_RETRY_S = 1.0  # while the index is down, the probe asks it this often


class PlacementRecorder:
    """Records where Serve placed each request, in ``WorkerRequest.routed_to``. A router
    sets it to its first choice; Serve takes a later rank when that one is full, and says
    where it went here once the replica accepted. A call lost before it sent anything (its
    worker hung) is then pinned on the worker it ran on, not on the one that was full."""

    role: str

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request = _worker_request(pending_request)
        if request is not None:
            request.routed_to = worker_name(self.role, replica_id.unique_id)


class KvAwareRequestRouter(PlacementRecorder, RequestRouter):
    def initialize_state(
        self,
        role: str = "worker",
        block_size: int = 16,
        connector: bool = True,
    ) -> None:
        self.role = role
        self.router = Router("kv_aware", block_size, connector)
        self.fingerprint: str | None = None  # the index's; the first request brings it
        self._index: Any = None
        self._index_down = False  # a call failed; the probe has not had an answer since
        self._probe: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _worker_request(pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        candidate_replicas = not_lost_on(candidate_replicas, request)
        self.fingerprint = self.fingerprint or request.fingerprint
        replicas = {worker_name(self.role, r.replica_id.unique_id): r for r in candidate_replicas}
        # One decision at a time in this router: a burst must see its own earlier choices.
        # Other routers (other ingress replicas) are caught by the index: a pending entry
        # that raced ours makes it refuse ours, and we decide again on a fresh view.
        async with self._lock:
            if request.plan is not None and request.plan.pending_id is not None:
                await self._index_call("drop_pending", request.plan.pending_id)  # a re-route
            # Each replica's measured costs, as it reported them last (every second).
            self.router.learn({w: r.routing_stats for w, r in replicas.items() if r.routing_stats})
            for _ in range(MAX_RACES):
                plan = await self._plan(request, replicas)
                if plan is not None:
                    break
            else:
                plan = await self._plan(request, replicas, claim=False)
            assert plan is not None
            request.plan = plan
            request.routed_to = plan.worker
        others = [r for w, r in sorted(replicas.items()) if w != plan.worker]
        return [[replicas[plan.worker]], others]

    async def _plan(
        self, request: WorkerRequest, replicas: dict[str, RunningReplica], claim: bool = True
    ) -> Plan | None:
        """Choose a worker and record the prompt as pending there; None if another router
        recorded the same prompt since our lookup (then decide again)."""
        info = without(await self._index_call("route_lookup", request.chain) or {}, request.lost_on)
        views = self._views(replicas, info)
        choice = self.router.choose(sorted(replicas), views, request.num_context_tokens)
        n = self.router.hit_blocks(request.num_context_tokens)
        holder = _holder(info, choice.worker, self.router, n)
        plan = Plan(
            worker=choice.worker,
            local_blocks=choice.local_blocks,
            pull_blocks=choice.pull_blocks,
            compute_tokens=choice.compute_tokens,
            holder=choice.wait_for or holder,
            wait_for=choice.wait_for,
            wait_blocks=choice.local_blocks + choice.pull_blocks if choice.wait_for else 0,
            queue=views[choice.worker].queue,
        )
        blocks = request.num_context_tokens // self.router.block_size
        if claim and info and choice.compute_tokens and blocks:
            seen = info.get("last_pending_id")
            args = (choice.worker, request.chain[:blocks], choice.compute_tokens)
            plan.pending_id = await self._index_call("add_pending", *args, PENDING_TTL_S, seen)
            if plan.pending_id is None and self._index is not None:
                return None  # raced: the index refused the entry
        return plan

    def _views(self, replicas: dict[str, RunningReplica], info: dict) -> dict[str, WorkerView]:
        held, pending, backlog, queued, tiers, nodes = (
            info.get(k, {}) for k in ("held", "pending", "backlog", "queued", "tiers", "nodes")
        )
        views = {}
        for w, r in replicas.items():
            p = pending.get(w, {})
            # Serve's queue length counts what this router sent (and what a probe saw); the
            # index's pending entries count every router's prompts not yet computed there.
            # The replica's own report (running and waiting requests) is up to a second
            # old: a burst that just finished there would still read as a queue, so it
            # counts only when the index cannot answer.
            queue = max(self.replica_queue_len_cache.get(r.replica_id) or 0, queued.get(w, 0))
            stats = r.routing_stats or {}
            if not info:
                queue = max(queue, int(stats.get("running", 0)) + int(stats.get("waiting", 0)))
            room = stats.get("room_blocks")
            t = tiers.get(w, {})
            views[w] = WorkerView(
                queue=queue,
                backlog_tokens=backlog.get(w, 0),
                depth=held.get(w, 0),
                pending=p.get("depth", 0),
                pending_wait_tokens=p.get("wait_tokens", 0),
                room_blocks=int(room) if room is not None else None,
                host_depth=t.get("host", 0),
                disk_depth=t.get("disk", 0),
                node=nodes.get(w),
            )
        return views

    async def _index_call(self, method: str, *args: Any) -> Any:
        """One index call; None while the index is down or when the call fails (then routing
        uses load only until the probe hears from the index again)."""
        if not self.router.connector or self.fingerprint is None:
            return None
        if self._index_down:
            if self._probe is None or self._probe.done():
                self._probe = asyncio.create_task(self._probe_index())
            return None
        try:
            if self._index is None:
                self._index = get_index_actor(self.fingerprint)
            ref = getattr(self._index, method).remote(*args)
            return await asyncio.wait_for(ref, INDEX_TIMEOUT_S)
        except Exception as e:
            logger.warning("index %s failed (%r); routing by load for now", method, e)
            self._index = None  # a new or restarted index is found by name again
            self._index_down = True
            return None

    async def _probe_index(self) -> None:
        """Ask the index (found by name: a new one if it died) until it answers, every
        ``INDEX_RETRY_S``; then it is up again. No request waits on this."""
        while self._index_down:
            await asyncio.sleep(INDEX_RETRY_S)
            try:
                index = get_index_actor(self.fingerprint)
                await asyncio.wait_for(index.incarnation.remote(), INDEX_TIMEOUT_S)
            except Exception:
                continue
            self._index, self._index_down = index, False
            logger.info("index answers again; routing by its view")


class RoundRobinRequestRouter(PlacementRecorder, RequestRouter):
    """Each replica in turn (the baseline): no index, no queue lengths."""

    def initialize_state(self, role: str = "worker", **_: Any) -> None:
        self.role = role
        self._turn = itertools.count()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _worker_request(pending_request)
        candidates = not_lost_on(candidate_replicas, request)
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        i = next(self._turn) % len(ordered)
        if request is not None:
            request.routed_to = worker_name(self.role, ordered[i].replica_id.unique_id)
        return [[ordered[i]], ordered[i + 1 :] + ordered[:i]]


def not_lost_on(
    candidates: list[RunningReplica], request: WorkerRequest | None
) -> list[RunningReplica]:
    """The candidates ``request`` was not lost on, unless that leaves none."""
    if request is None or not request.lost_on:
        return candidates
    lost = {replica_id_of(w) for w in request.lost_on}
    return [r for r in candidates if r.replica_id.unique_id not in lost] or candidates


# ``route_lookup``'s maps of what each worker holds or owes (``nodes`` says where it is).
_HOLDINGS = ("held", "tiers", "pending", "backlog", "queued")


def without(info: dict, workers: Sequence[str]) -> dict:
    """``info`` (``route_lookup``'s answer) as if ``workers`` held and owed nothing: a request
    lost on a worker neither waits for it nor pulls from it. Its engine may be hung too (a
    stopped process, a cut-off host): each pull planned from it waits out its pin's timeout
    in the puller's one load thread, and the requests queued behind with it."""
    if not workers or not info:
        return info
    gone = set(workers)
    return {
        **info,
        **{
            k: {w: v for w, v in info[k].items() if w not in gone}
            for k in _HOLDINGS
            if isinstance(info.get(k), dict)
        },
    }


def _worker_request(pending: PendingRequest | None) -> WorkerRequest | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, WorkerRequest):
            return arg
    return None


def _holder(info: dict, worker: str, router: Router, n: int) -> str | None:
    """The peer ``worker`` pulls from (``Router.pick_holder``) among every worker the index
    knows (a prefill worker of another deployment included), by :func:`pullable_depth` up to
    the ``n`` blocks of the prompt that can hit, as the router priced it."""
    depths = pullable_depths(info.get("held", {}), info.get("tiers", {}), exclude=worker)
    capped = {w: min(d, n) for w, d in depths.items()}
    return router.pick_holder(worker, capped, info.get("nodes", {}))
