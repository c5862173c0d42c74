"""``ClusterKvConnector``: the seam implemented over the cluster index and a block transport.

After a local prefix miss, ``lookup`` asks the index which peer holds the longest run of the
missing blocks. ``load`` then asks that peer to pin them under a lease, reads them into the
freshly allocated local blocks with one transfer, and releases the lease. Any failure (peer
gone, blocks no longer held, lease expired, timeout, size mismatch, refused peer) returns
False: the manager computes those tokens instead, so wrong KV is never used.

Events for the index (``Stored`` / ``Removed`` / ``Cleared``) are buffered on the step thread
and sent by a publisher thread in batches, so a step never waits on the index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from kvmesh.connector.events import EventPublisher
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.connector.transport import BlockTransport, TransferError, make_transport
from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.engine import ConnectorContext
from kvmesh.workers.kv_connector import KvCacheConnector

logger = logging.getLogger(__name__)
# The first worker of a model starts the index actor: a new process, seconds on a busy host.
REGISTER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ClusterConnectorConfig:
    """Built by the cluster layer and shipped to each worker actor (it is picklable)."""

    transport: str | None = None  # "nixl", "ray", or None: NIXL when importable
    lease_s: float = 10.0  # how long a holder keeps blocks pinned for one pull
    timeout_s: float = 5.0  # index round trips, pins and transfers
    publish_interval_s: float = 0.02
    heartbeat_interval_s: float = 1.0
    min_pull_blocks: int = 1  # pull only when a peer has at least this many more blocks

    def __call__(self, ctx: ConnectorContext) -> ClusterKvConnector:
        return ClusterKvConnector(ctx, self)


class ClusterKvConnector(KvCacheConnector):
    def __init__(self, ctx: ConnectorContext, config: ClusterConnectorConfig) -> None:
        self.worker_id = ctx.worker_id
        self.config = config
        self.transport: BlockTransport = make_transport(
            config.transport, ctx.worker_id, ctx.kv_cache, ctx.fingerprint.id
        )
        self.index = get_index_actor(ctx.fingerprint.id)
        self._service: Callable[[], None] = lambda: None
        self._planned: tuple[str, int] | None = None  # (holder, blocks) from the last lookup
        self._peers: dict[str, Any] = {}  # worker id -> actor handle, once added to transport
        self._lock = threading.Lock()  # guards the publisher and the mirror below
        self._flush_lock = threading.Lock()  # one batch in flight
        self._publisher = EventPublisher(self.worker_id)
        self._held: set[BlockHash] = set()  # mirror of the pool's cached hashes, for snapshots
        self.stats: dict[str, float] = {
            "pull_s": 0.0,  # time inside transport reads
            "lookups": 0,
            "pulls": 0,
            "pulled_blocks": 0,
            "pulled_bytes": 0,
            "pull_failures": 0,
            "batches_sent": 0,
            "snapshots_sent": 0,
        }
        self._handle = ray.get_runtime_context().current_actor
        self._fingerprint_id = ctx.fingerprint.id
        self._register()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._publish_loop, name=f"{self.worker_id}-publish", daemon=True
        )
        self._thread.start()

    def _register(self) -> None:
        ray.get(
            self.index.register.remote(
                self.worker_id,
                self._fingerprint_id,
                # Peers find our transport info and actor handle here (pins go to the handle).
                {"transport": self.transport.local_info(), "handle": self._handle},
                self._handle,
            ),
            timeout=REGISTER_TIMEOUT_S,
        )

    def attach(self, service: Callable[[], None]) -> None:
        self._service = service

    # -- lookup and load (step thread) --------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        self._planned = None
        self.stats["lookups"] += 1
        try:
            depths = self._wait(self.index.lookup.remote(list(hashes), self.worker_id))
        except Exception as e:
            logger.warning("%s: index lookup failed (%s); computing", self.worker_id, e)
            return 0
        if not depths:
            return 0
        holder, depth = max(depths.items(), key=lambda kv: (kv[1], kv[0]))
        if depth < self.config.min_pull_blocks:
            return 0
        self._planned = (holder, depth)
        return depth

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        planned, self._planned = self._planned, None
        if planned is None or len(hashes) > planned[1]:
            return False
        holder = planned[0]
        try:
            handle = self._peer(holder)
            lease = self._wait(handle.pin.remote(list(hashes), self.config.lease_s))
            if lease is None:  # evicted since the lookup: the index was a hint
                raise TransferError(f"{holder} no longer holds the blocks")
            lease_id, remote_ids = lease
            try:
                if len(remote_ids) != len(block_ids):
                    raise TransferError(f"{holder} pinned {len(remote_ids)} blocks")
                started = time.perf_counter()
                nbytes = self.transport.read_blocks(
                    holder, remote_ids, list(block_ids), self.config.timeout_s
                )
                self.stats["pull_s"] += time.perf_counter() - started
            finally:
                handle.release.remote(lease_id)  # fire and forget; expiry covers a lost call
        except Exception as e:
            self.stats["pull_failures"] += 1
            logger.warning(
                "%s: pull of %d blocks from %s failed: %s", self.worker_id, len(hashes), holder, e
            )
            return False
        self.stats["pulls"] += 1
        self.stats["pulled_blocks"] += len(hashes)
        self.stats["pulled_bytes"] += nbytes
        return True

    def _peer(self, worker_id: str) -> Any:
        """The peer's actor handle, adding it to the transport the first time (checks the
        fingerprint: a refused peer raises PeerRefused)."""
        if worker_id not in self._peers:
            workers = self._wait(self.index.workers.remote())
            meta = workers.get(worker_id)
            if meta is None or meta.get("handle") is None:
                raise TransferError(f"{worker_id} is not registered")
            self.transport.add_peer(meta["transport"], meta["handle"])
            self._peers[worker_id] = meta["handle"]
        return self._peers[worker_id]

    def _wait(self, ref: ray.ObjectRef) -> Any:
        """ray.get that keeps serving peers' pins while it waits (no pull deadlocks)."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            ready, _ = ray.wait([ref], timeout=0.002)
            if ready:
                return ray.get(ready[0])
            self._service()
            if time.monotonic() > deadline:
                ray.cancel(ref)
                raise TransferError("timed out waiting for a peer or the index")

    # -- observations (step thread) -------------------------------------------------------

    def on_store(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        with self._lock:
            self._publisher.on_store(list(hashes), None)
            self._held.update(hashes)

    def on_evict(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._publisher.on_remove(list(hashes))
            self._held.difference_update(hashes)

    def on_clear(self) -> None:
        with self._lock:
            self._publisher.on_clear()
            self._held.clear()

    # -- the publisher thread -----------------------------------------------------------------

    def _publish_loop(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(self.config.publish_interval_s):
            try:
                self.flush()
                now = time.monotonic()
                if now - last_beat > self.config.heartbeat_interval_s:
                    last_beat = now
                    known = ray.get(
                        self.index.heartbeat.remote(self.worker_id),
                        timeout=self.config.timeout_s,
                    )
                    if not known:  # purged (missed heartbeats, or a new index): rejoin
                        with self._flush_lock:
                            self._rejoin()
            except Exception as e:  # the index may be restarting; keep the worker alive
                logger.warning("%s: publishing to the index failed: %s", self.worker_id, e)

    def flush(self) -> int:
        """Send every buffered batch now; returns how many. Sends a snapshot on a gap.

        Callable from any thread; one batch is in flight at a time (the index applies a
        worker's batches in sequence order, and a threaded actor may reorder concurrent calls).
        """
        with self._flush_lock:
            return self._flush()

    def _flush(self) -> int:
        sent = 0
        while True:
            with self._lock:
                batch = self._publisher.drain()
            if batch is None:
                return sent
            result = ray.get(self.index.apply.remote(batch), timeout=self.config.timeout_s)
            sent += 1
            self.stats["batches_sent"] += 1
            if result == "gap":
                self._send_snapshot()
            elif result == "rejected" and not ray.get(
                self.index.heartbeat.remote(self.worker_id), timeout=self.config.timeout_s
            ):
                self._rejoin()

    def _rejoin(self) -> None:
        """Register again (a new incarnation: the index forgot us) and send a snapshot."""
        logger.warning("%s: the index does not know this worker; re-registering", self.worker_id)
        self._register()
        self._send_snapshot(reset=True)

    def _send_snapshot(self, reset: bool = False) -> None:
        with self._lock:
            # After a rejoin the snapshot already holds what is buffered: drop the buffer.
            next_seq = self._publisher.reset_for_snapshot() if reset else self._publisher.next_seq
            hashes = list(self._held)
        ray.get(
            self.index.apply_snapshot.remote(self.worker_id, hashes, next_seq),
            timeout=self.config.timeout_s,
        )
        self.stats["snapshots_sent"] += 1

    def get_stats(self) -> dict[str, float]:
        return dict(self.stats)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self.flush()
            ray.get(self.index.deregister.remote(self.worker_id), timeout=self.config.timeout_s)
        except Exception as e:
            logger.warning("%s: deregistering failed: %s", self.worker_id, e)
        self.transport.close()
