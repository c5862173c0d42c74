"""``KvIndexActor``: the cluster's one index per model fingerprint, a thin Ray actor over KvIndex.

The actor adds what a plain class cannot know: liveness. A worker is purged when its last sign
of life (register, heartbeat, or a batch of its own) is older than ``heartbeat_timeout_s``, or
when the Ray actor handle it registered with has died. A background thread checks both. The
actor is asynchronous: its calls run one at a time on its event loop, except that a
``wait_stored`` awaits the next change of the index, so many can wait while lookups and
batches are served; one lock serialises every touch of the KvIndex between the loop and the
liveness thread. Time the actor itself did not run (a stopped or starved process) is not its
workers' silence: the check credits it back, so an index resumed after a long pause does not
purge every worker at once.

Incarnation: the actor is a hint, and may die. ``get_index_actor`` creates it restartable
(``max_restarts=-1``): a crash restarts it empty under the same name, and after a kill for
good the next ``get_index_actor`` creates a new one. Each start draws a new ``incarnation``
(uuid4 hex), returned by ``register`` and ``heartbeat``; a worker that sees another one (or
None: "unknown worker") re-registers and sends a full snapshot.

Tokens: any Ray driver on the cluster can call this actor. ``register`` returns a secret token
with the incarnation; ``apply`` / ``apply_many`` / ``apply_snapshot`` / ``heartbeat`` /
``deregister`` (and a re-``register``) of a worker need that worker's token, and are refused
and counted (``unauthorized`` in ``stats``) otherwise. The token is not in ``workers()``.
Pending entries and queries stay open: routers, which hold no worker's token, add and drop
pending entries, and every answer is a hint; only a worker's token confirms an entry of that
worker, which then lives its whole time to live (``pending_entries.py``).

Ordering: an asynchronous actor may run two calls of one caller out of order, so a worker keeps at
most one ``apply`` in flight (or sends several through one ``apply_many``); a reordering
otherwise costs a gap and a snapshot, never wrong state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvmesh.connector.kv_index import DEFAULT_PENDING_TTL_S, KvIndex

logger = logging.getLogger(__name__)

ACTOR_NAME_PREFIX = "kvmesh-index-"
# Calls in flight at once: coroutines on one event loop (a threaded actor starts all its
# threads at once, 256 of them here before), each ``wait_stored`` counting while it waits.
MAX_CONCURRENCY = 1000


@ray.remote(num_cpus=0, max_concurrency=MAX_CONCURRENCY)
class KvIndexActor:
    """Serves one :class:`KvIndex`; methods mirror it, plus :meth:`heartbeat` and liveness.

    ``heartbeat_timeout_s=None`` disables the heartbeat purge (dead handles are still purged).
    ``check_interval_s`` defaults to a quarter of the timeout, at most one second.
    """

    def __init__(
        self,
        fingerprint: str,
        heartbeat_timeout_s: float | None = 10.0,
        check_interval_s: float | None = None,
    ) -> None:
        self._index = KvIndex(fingerprint)
        self._incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._changed = asyncio.Event()  # set and replaced at every change (_notify)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by the first wait_stored
        self._waiters = 0  # wait_stored calls now (on the loop's thread)
        self._timeout = heartbeat_timeout_s
        if check_interval_s is None:
            check_interval_s = min(1.0, (heartbeat_timeout_s or 4.0) / 4)
        self._interval = check_interval_s
        self._last_seen: dict[str, float] = {}
        self._handles: dict[str, Any] = {}  # worker_id -> its ActorHandle
        self._pings: dict[str, tuple[Any, ray.ObjectRef]] = {}  # one ping in flight per worker
        self._purged = {"purged_dead": 0, "purged_stale": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._liveness_loop, name="kvmesh-liveness")
        self._thread.daemon = True  # dies with the actor process; nothing to flush
        self._thread.start()

    # -- workers ---------------------------------------------------------------------------

    def incarnation(self) -> str:
        """This start of the actor's id (uuid4 hex): a restarted index has another one."""
        return self._incarnation

    def register(
        self,
        worker_id: str,
        fingerprint: str,
        metadata: dict | None = None,
        handle: Any = None,
        token: str | None = None,
    ) -> tuple[str, str]:
        """:meth:`KvIndex.register`; ``handle`` (the worker's ActorHandle) is watched for death.

        Returns (incarnation, token): the worker compares the incarnation with later
        heartbeats, and passes the token (a secret) with every call about itself. ``token``:
        its current one, needed to re-register a worker this index knows (PermissionError).
        """
        with self._lock:
            new_token = self._index.register(worker_id, fingerprint, metadata, token)
            self._last_seen[worker_id] = time.monotonic()
            self._pings.pop(worker_id, None)
            if handle is None:
                self._handles.pop(worker_id, None)
            else:
                self._handles[worker_id] = handle
            self._notify()
        return self._incarnation, new_token

    def deregister(self, worker_id: str, token: str | None) -> bool:
        """Purge the worker; False if it was not registered, PermissionError for a wrong
        token."""
        with self._lock:
            if worker_id not in self._last_seen:
                return False
            self._index.authorize(worker_id, token)
            return self._forget(worker_id)

    def heartbeat(self, worker_id: str, token: str | None) -> str | None:
        """Refresh liveness and return the incarnation; None means the worker is unknown
        (purged, or this index restarted): it must re-register. PermissionError for a wrong
        token (nothing refreshed)."""
        with self._lock:
            if worker_id not in self._last_seen:
                return None
            self._index.authorize(worker_id, token)
            self._last_seen[worker_id] = time.monotonic()
            return self._incarnation

    def needs_snapshot(self, worker_id: str) -> bool:
        with self._lock:
            return self._index.needs_snapshot(worker_id)

    def workers(self) -> dict[str, dict]:
        with self._lock:
            return self._index.workers()

    # -- events ----------------------------------------------------------------------------

    def apply(self, data: bytes, token: str | Mapping[str, str] | None) -> str:
        """:meth:`KvIndex.apply`; returns the status string (``rejected`` for a wrong token)."""
        return self.apply_many([data], token)[0]

    def apply_many(
        self, batches: Sequence[bytes], token: str | Mapping[str, str] | None
    ) -> list[str]:
        """Apply batches in the given order under one lock: one round trip for several.

        ``token``: their worker's token, or worker id -> token for several workers' batches.
        """
        out = []
        with self._lock:
            now = time.monotonic()
            for data in batches:
                result = self._index.apply(data, token)
                if result.status == "rejected" and result.reason:
                    logger.debug("rejected batch: %s", result.reason)
                elif result.worker_id in self._last_seen:
                    self._last_seen[result.worker_id] = now
                out.append(result.status)
            self._notify()
        return out

    def apply_snapshot(
        self,
        worker_id: str,
        hashes: list[bytes],
        next_seq: int,
        token: str | None,
        tiers: Mapping[str, list[bytes]] | None = None,
    ) -> None:
        """:meth:`KvIndex.apply_snapshot` (KeyError unknown, PermissionError wrong token):
        ``hashes`` the device pool's, ``tiers`` ``{"host": [...], "disk": [...]}`` (a medium
        left out, or ``tiers`` None, is emptied)."""
        with self._lock:
            self._index.apply_snapshot(worker_id, hashes, next_seq, token, tiers)
            self._last_seen[worker_id] = time.monotonic()
            self._notify()

    # -- pending entries -------------------------------------------------------------------

    def add_pending(
        self,
        worker_id: str,
        hashes: Sequence[bytes],
        tokens: int,
        ttl_s: float = DEFAULT_PENDING_TTL_S,
        seen: int | None = None,
    ) -> int | None:
        """:meth:`KvIndex.add_pending`: ``worker_id`` computes these leading blocks now."""
        with self._lock:
            return self._index.add_pending(worker_id, hashes, tokens, ttl_s, seen)

    def confirm_pending(
        self, worker_id: str, pending_id: int, hashes: Sequence[bytes], token: str | None
    ) -> bool:
        """:meth:`KvIndex.confirm_pending`: the worker got the entry's request."""
        with self._lock:
            return self._index.confirm_pending(worker_id, pending_id, hashes, token)

    def drop_pending(self, pending_id: int) -> bool:
        with self._lock:
            dropped = self._index.drop_pending(pending_id)
            self._notify()
            return dropped

    def pending(self) -> dict[int, dict[str, Any]]:
        """:meth:`KvIndex.pending`: every live entry by id (for operators and tests)."""
        with self._lock:
            return self._index.pending()

    def route_lookup(self, hashes: Sequence[bytes]) -> dict[str, Any]:
        """:meth:`KvIndex.route_lookup` (``held``, ``tiers``, ``pending``, ...) plus
        ``"incarnation"``."""
        with self._lock:
            return {"incarnation": self._incarnation, **self._index.route_lookup(hashes)}

    async def wait_stored(self, worker_id: str, hashes: Sequence[bytes], timeout_s: float) -> int:
        """Wait until ``worker_id`` holds all of ``hashes`` (per the index), or no pending entry
        of it covers more of them than it holds (dropped, stored, expired, purged), or
        ``timeout_s``; return how many leading blocks of ``hashes`` it holds then."""
        self._loop = asyncio.get_running_loop()
        deadline = time.monotonic() + max(0.0, timeout_s)
        self._waiters += 1  # before the first check: every change after it notifies
        try:
            while True:
                changed = self._changed  # before the check: a change after it sets this one
                with self._lock:
                    held = self._index.held_depth(worker_id, hashes)
                    if held >= len(hashes) or self._index.pending_depth(worker_id, hashes) <= held:
                        return held
                    now = time.monotonic()
                    if now >= deadline:
                        return held
                    wake = deadline  # or when the next entry expires (expiry notifies nobody)
                    expiry = self._index.next_pending_expiry()
                    if expiry is not None:
                        wake = min(wake, expiry)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), max(wake - now, 0.001))
        finally:
            self._waiters -= 1

    # -- queries ---------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], exclude: str | None = None) -> dict[str, int]:
        with self._lock:
            return self._index.lookup(hashes, exclude)

    def pull_depths(self, hashes: Sequence[bytes], exclude: str | None = None) -> dict[str, int]:
        with self._lock:
            return self._index.pull_depths(hashes, exclude)

    def lookup_many(
        self, chains: Sequence[Sequence[bytes]], exclude: str | None = None
    ) -> list[dict[str, int]]:
        """One :meth:`lookup` per chain, in one round trip (a router batching its requests)."""
        with self._lock:
            return [self._index.lookup(hashes, exclude) for hashes in chains]

    def snapshot(self) -> dict[str, list[bytes]]:
        with self._lock:
            return self._index.snapshot()

    def stats(self) -> dict[str, int]:
        """The index's counters plus ``purged_dead`` and ``purged_stale``."""
        with self._lock:
            return {**self._index.stats(), **self._purged}

    # -- liveness --------------------------------------------------------------------------

    def _forget(self, worker_id: str) -> bool:
        """Drop a worker everywhere; the caller holds the lock."""
        self._last_seen.pop(worker_id, None)
        self._handles.pop(worker_id, None)
        self._pings.pop(worker_id, None)
        purged = self._index.purge(worker_id)
        self._notify()
        return purged

    def _notify(self) -> None:
        """Wake every ``wait_stored`` (from any thread); no call onto the loop if none waits."""
        if self._loop is not None and self._waiters:
            self._loop.call_soon_threadsafe(self._wake_waiters)

    def _wake_waiters(self) -> None:  # on the loop: waiters hold the event they wait on
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _liveness_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            paused, last = now - last - self._interval, now
            try:
                if paused > self._interval:
                    self._excuse(paused, now)
                self._purge_stale()
                self._ping_handles()
            except Exception:  # the check must outlive any one bad round
                logger.exception("kvmesh index liveness check failed")

    def _excuse(self, paused: float, now: float) -> None:
        """This process did not run for ``paused`` seconds (stopped, swapped out, starved):
        the workers could not be heard meanwhile, so that time does not count as their
        silence (without this, an index resumed after a pause longer than the timeout purged
        every worker at once)."""
        with self._lock:
            for worker_id, seen in self._last_seen.items():
                self._last_seen[worker_id] = min(now, seen + paused)
        logger.warning("kvmesh index did not run for %.1f s; its workers are not blamed", paused)

    def _purge_stale(self) -> None:
        if self._timeout is None:
            return
        with self._lock:
            deadline = time.monotonic() - self._timeout
            for worker_id in [w for w, t in self._last_seen.items() if t < deadline]:
                logger.warning("purging worker %s: no heartbeat for %ss", worker_id, self._timeout)
                self._forget(worker_id)
                self._purged["purged_stale"] += 1

    def _ping_handles(self) -> None:
        """Keep one ``__ray_ready__`` ping in flight per handle; a dead actor's fails fast.

        A busy worker's ping just waits (never purged for being slow); only ActorDiedError and
        kin purge, not ActorUnavailableError (a restarting actor).
        """
        with self._lock:
            for worker_id, handle in self._handles.items():
                if worker_id not in self._pings:
                    self._pings[worker_id] = (handle, handle.__ray_ready__.remote())
            pings = dict(self._pings)
        refs = [ref for _, ref in pings.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        ready_set = set(ready)
        dead = []
        for worker_id, (handle, ref) in pings.items():
            if ref not in ready_set:
                continue
            try:
                ray.get(ref)
            except ActorUnavailableError:
                pass
            except RayActorError:
                dead.append((worker_id, handle))
            except Exception:
                logger.exception("ping of worker %s failed", worker_id)
            with self._lock:
                if self._pings.get(worker_id, (None, None))[1] is ref:
                    del self._pings[worker_id]
        with self._lock:
            for worker_id, handle in dead:
                # A re-register in between brought a new handle: that one is not known dead.
                if self._handles.get(worker_id) is handle:
                    logger.warning("purging worker %s: its actor died", worker_id)
                    self._forget(worker_id)
                    self._purged["purged_dead"] += 1


def get_index_actor(
    fingerprint_id: str,
    namespace: str | None = "kvmesh",
    *,
    heartbeat_timeout_s: float | None = 10.0,
    check_interval_s: float | None = None,
) -> Any:
    """The named index actor of ``fingerprint_id``, created when none is alive.

    One actor per model fingerprint, named ``kvmesh-index-<fingerprint_id>``. The liveness
    arguments only take effect when this call creates it. Detached: the first worker to ask
    creates it, and it must outlive that worker (a non-detached actor dies with its owner);
    it goes with the Ray cluster. Restartable: a crash, or ``ray.kill(h, no_restart=False)``,
    restarts it empty (a new incarnation) under the same name and handle. ``ray.kill(h)`` ends
    it for good; the next call here then creates a new one (callers racing get the same one).
    """
    return KvIndexActor.options(
        name=f"{ACTOR_NAME_PREFIX}{fingerprint_id}",
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=-1,
        # Never inside the caller's placement group: a worker runs in its Serve replica's
        # group, which is removed with the replica, and would take the index with it (and
        # leave its restart unschedulable).
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
    ).remote(fingerprint_id, heartbeat_timeout_s, check_interval_s)
