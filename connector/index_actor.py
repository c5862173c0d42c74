"""``KvIndexActor``: the cluster's one index per model fingerprint, a thin Ray actor over KvIndex.

The actor adds what a plain class cannot know: liveness. A worker is purged when its last sign
of life (register, heartbeat, or a batch of its own) is older than ``heartbeat_timeout_s``, or
when the Ray actor handle it registered with has died. A background thread checks both; the
actor is threaded (``max_concurrency``), so lookups and batches are served meanwhile, and one
lock serialises every touch of the KvIndex.

Ordering: a threaded actor may run two calls of one caller out of order, so a worker keeps at
most one ``apply`` in flight (or sends several through one ``apply_many``); a reordering
otherwise costs a gap and a snapshot, never wrong state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from kvmesh.connector.kv_index import KvIndex

logger = logging.getLogger(__name__)

ACTOR_NAME_PREFIX = "kvmesh-index-"


@ray.remote(num_cpus=0, max_concurrency=16)
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
        self._lock = threading.Lock()
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

    def register(
        self, worker_id: str, fingerprint: str, metadata: dict | None = None, handle: Any = None
    ) -> None:
        """:meth:`KvIndex.register`; ``handle`` (the worker's ActorHandle) is watched for death."""
        with self._lock:
            self._index.register(worker_id, fingerprint, metadata)
            self._last_seen[worker_id] = time.monotonic()
            self._pings.pop(worker_id, None)
            if handle is None:
                self._handles.pop(worker_id, None)
            else:
                self._handles[worker_id] = handle

    def deregister(self, worker_id: str) -> bool:
        """Purge the worker; False if it was not registered."""
        with self._lock:
            return self._forget(worker_id)

    def heartbeat(self, worker_id: str) -> bool:
        """Refresh liveness; False means the worker is unknown (purged): it must re-register."""
        with self._lock:
            if worker_id not in self._last_seen:
                return False
            self._last_seen[worker_id] = time.monotonic()
            return True

    def needs_snapshot(self, worker_id: str) -> bool:
        with self._lock:
            return self._index.needs_snapshot(worker_id)

    def workers(self) -> dict[str, dict]:
        with self._lock:
            return self._index.workers()

    # -- events ----------------------------------------------------------------------------

    def apply(self, data: bytes) -> str:
        """:meth:`KvIndex.apply`; returns the status string."""
        return self.apply_many([data])[0]

    def apply_many(self, batches: Sequence[bytes]) -> list[str]:
        """Apply batches in the given order under one lock: one round trip for several."""
        out = []
        with self._lock:
            now = time.monotonic()
            for data in batches:
                result = self._index.apply(data)
                if result.status == "rejected" and result.reason:
                    logger.debug("rejected batch: %s", result.reason)
                elif result.worker_id in self._last_seen:
                    self._last_seen[result.worker_id] = now
                out.append(result.status)
        return out

    def apply_snapshot(self, worker_id: str, hashes: list[bytes], next_seq: int) -> None:
        with self._lock:
            self._index.apply_snapshot(worker_id, hashes, next_seq)
            self._last_seen[worker_id] = time.monotonic()

    # -- queries ---------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], exclude: str | None = None) -> dict[str, int]:
        with self._lock:
            return self._index.lookup(hashes, exclude)

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
        return self._index.purge(worker_id)

    def _liveness_loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._purge_stale()
                self._ping_handles()
            except Exception:  # the check must outlive any one bad round
                logger.exception("kvmesh index liveness check failed")

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
    """The named index actor of ``fingerprint_id``, created on first call.

    One actor per model fingerprint, named ``kvmesh-index-<fingerprint_id>``. The liveness
    arguments only take effect when this call creates it. Detached: the first worker to ask
    creates it, and it must outlive that worker (a non-detached actor dies with its owner);
    it goes with the Ray cluster, or ``ray.kill`` ends it.
    """
    return KvIndexActor.options(
        name=f"{ACTOR_NAME_PREFIX}{fingerprint_id}",
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
    ).remote(fingerprint_id, heartbeat_timeout_s, check_interval_s)
