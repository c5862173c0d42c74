"""``ClusterKvConnector``: the seam implemented over the cluster index and a block transport.

After a local prefix miss, ``lookup`` says how many blocks a peer can supply: the router's
plan when one came and its holder is a known peer, else the index's answer (asked on a thread
of its own: ``None`` until it comes). ``start_load`` queues the pull: pin the blocks at the
holder under a lease, read them into the freshly allocated local blocks with one transfer,
release the lease; ``poll_loads`` reports how it ended. All of that runs on the loader's
threads (``async_load.py``), never on the step thread. Any failure (peer gone, blocks no
longer held, lease expired, timeout, size mismatch, refused peer) reports 0 blocks: the
manager computes those tokens instead, so wrong KV is never used.

Events for the index (``Stored`` / ``Removed`` / ``Cleared``) are buffered on the step thread
and sent by a publisher thread in batches, so a step never waits on the index.

The index is a hint, and it can die. Every index call goes through :meth:`_call`: a dead or
restarting index makes the connector re-resolve the named actor (``get_index_actor``, which
creates a new one when the old one was killed for good; at most every ``RESOLVE_INTERVAL_S``)
and marks it "must rejoin"; the publisher thread then registers again and sends a full
snapshot, as it does when a heartbeat shows another incarnation or an unknown worker. Until
then lookups answer 0 and flushes return at once. A call that times out (a hung index: a stopped
or starved process) marks it unresponsive instead: lookups answer 0 at once, and the first
call that is answered again (the publisher thread keeps trying) clears it, so a hung index
costs one lookup one timeout, not every lookup one each. No index failure escapes a
connector method: raised out of a worker actor's call, a RayActorError would read as the
*worker* having died.

``register`` hands back a secret token with the incarnation; the connector keeps it and sends
it with every call about itself (batches, snapshots, heartbeats, deregistration, its next
register), so no other caller can speak for this worker. A rejoin gets a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from kvmesh.connector.async_load import PullLoader
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.connector.events import EventPublisher
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.connector.transport import BlockTransport, TransferError, make_transport
from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.engine import ConnectorContext
from kvmesh.workers.kv_connector import KvCacheConnector, LoadResult, PullPlan
from kvmesh.workers.peer_leases import MAX_PINNED_FRACTION

logger = logging.getLogger(__name__)
# The first worker of a model starts the index actor: a new process, seconds on a busy host.
REGISTER_TIMEOUT_S = 120.0
# Least time between two look-ups of the index actor by name, and between two rejoin tries.
RESOLVE_INTERVAL_S = 0.5
WARN_INTERVAL_S = 5.0  # index warnings are logged at most this often (the rest are counted)


class IndexUnavailable(Exception):
    """An index call failed: the index is dead, restarting, slow, or refused the call.

    Deliberately not a RayActorError: raised out of a worker actor's method, that would tell
    the caller the worker died.
    """


class ClusterKvConnector(KvCacheConnector):
    def __init__(self, ctx: ConnectorContext, config: ClusterConnectorConfig) -> None:
        self.worker_id = ctx.worker_id
        self.config = config
        self.transport: BlockTransport = make_transport(
            config.transport, ctx.worker_id, ctx.kv_cache, ctx.fingerprint.id, config.faults
        )
        self._fingerprint_id = ctx.fingerprint.id
        self.index = get_index_actor(self._fingerprint_id)
        self._resolve_lock = threading.Lock()
        self._resolved_at = float("-inf")
        self._incarnation: str | None = None  # of the index we registered with
        self._token: str | None = None  # our secret with that index (register returns it)
        self._must_rejoin = False  # the index died or forgot us: register again, snapshot
        self._unresponsive = False  # a call timed out, and none was answered since
        self._losses = 0  # index failures that call for a rejoin, ever
        self._next_rejoin = 0.0
        self._warned_at = -WARN_INTERVAL_S
        self._suppressed = 0
        self._max_pin_blocks = int(ctx.kv_cache.num_blocks * MAX_PINNED_FRACTION)
        self._lock = threading.Lock()  # guards the publisher and the mirror below
        self._flush_lock = threading.Lock()  # one batch in flight
        self._publisher = EventPublisher(self.worker_id)
        self._held: set[BlockHash] = set()  # mirror of the pool's cached hashes, for snapshots
        # Mirrors of the local tiers' blocks (workers/kv_tiers.py), for snapshots.
        self._tier_held: dict[str, set[BlockHash]] = {"host": set(), "disk": set()}
        self.stats: dict[str, float] = {
            "pull_s": 0.0,  # time inside transport reads, failed ones too
            "read_blocks": 0,  # blocks those reads asked for
            "lookups": 0,  # lookup calls (the step thread's)
            "index_lookups": 0,  # of those and of loads, the ones that asked the index
            "stale_plans": 0,  # lookups whose plan named a holder that is not a known peer
            "pulls": 0,
            "pulled_blocks": 0,
            "pulled_bytes": 0,
            "pull_failures": 0,
            "batches_sent": 0,
            "snapshots_sent": 0,
            "index_errors": 0,
            "rejoins": 0,
        }
        self._handle = ray.get_runtime_context().current_actor
        # The Ray node this worker's KV lives on: peers on it pull without crossing a network.
        self._node = ray.get_runtime_context().get_node_id()
        self._loader = PullLoader(
            self.worker_id,
            config,
            self.transport,
            self._call,
            lambda: self._must_rejoin or self._unresponsive,
            self.stats,
            node=self._node,
        )
        try:
            self._register()
        except IndexUnavailable as e:  # serve without the index; the publisher rejoins
            self._must_rejoin = True
            self._warn("registering with the index failed: %s", e)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._publish_loop, name=f"{self.worker_id}-publish", daemon=True
        )
        self._thread.start()

    def _register(self) -> None:
        self._incarnation, self._token = self._call(
            "register",
            self.worker_id,
            self._fingerprint_id,
            # Peers find our transport info and actor handle here (pins go to the handle),
            # and how many blocks we let them pin at most (PeerLeases.max_pinned_blocks).
            {
                "transport": self.transport.local_info(),
                "handle": self._handle,
                "max_pin_blocks": self._max_pin_blocks,
                "node": self._node,
            },
            self._handle,
            self._token,  # the index may still know us: only our token may re-register us
            timeout_s=REGISTER_TIMEOUT_S,
        )
        self._loader.refresh_directory()

    # -- index calls --------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Call an index method (never from the step thread); every failure raises
        IndexUnavailable.

        A dead or restarting index is re-resolved and calls for a rejoin, and so does an error
        raised inside the index (e.g. it no longer knows this worker); a timeout only raises.
        """
        index = self.index
        try:
            ref = getattr(index, method).remote(*args)
            answer = ray.get(ref, timeout=self.config.timeout_s if timeout_s is None else timeout_s)
            self._unresponsive = False
            return answer
        except RayActorError as e:  # killed, crashed, or restarting (ActorUnavailableError)
            self._index_lost(index)
            raise IndexUnavailable(f"index {method}: {type(e).__name__}: {e}") from e
        except RayTaskError as e:
            self._note_loss()
            raise IndexUnavailable(f"index {method} raised: {e}") from e
        except (GetTimeoutError, TransferError) as e:
            self._unresponsive = True
            raise IndexUnavailable(f"index {method} timed out") from e

    def _note_loss(self) -> None:
        """The index lost (or may have lost) this worker: a rejoin is due."""
        with self._resolve_lock:
            self._losses += 1
            self._must_rejoin = True

    def _index_lost(self, index: Any) -> None:
        """The index behind ``index`` died or restarts: look it up again, rejoin it."""
        self.stats["index_errors"] += 1
        self._note_loss()
        with self._resolve_lock:
            now = time.monotonic()
            # Another thread re-resolved since this call started, or did so just now.
            if self.index is not index or now - self._resolved_at < RESOLVE_INTERVAL_S:
                return
            self._resolved_at = now
            try:
                self.index = get_index_actor(self._fingerprint_id)
            except Exception as e:
                self._warn("looking the index up again failed: %s", e)

    def _warn(self, msg: str, *args: Any) -> None:
        """logger.warning, at most once per WARN_INTERVAL_S (an outage is one message)."""
        now = time.monotonic()
        if now - self._warned_at < WARN_INTERVAL_S:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" ({self._suppressed} more index warnings since the last one)"
        self._warned_at, self._suppressed = now, 0
        logger.warning("%s: " + msg, self.worker_id, *args)

    def attach(self, wake: Callable[[], None]) -> None:
        self._loader.wake = wake

    # -- lookup and loads (the step thread asks; the loader's threads wait) ------------------

    def lookup(self, hashes: Sequence[BlockHash], plan: PullPlan | None = None) -> int | None:
        return self._loader.lookup(hashes, plan)

    def start_load(
        self,
        load_id: int,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        plan: PullPlan | None = None,
    ) -> LoadResult | None:
        self._loader.start_load(load_id, hashes, block_ids, plan)
        return None

    def poll_loads(self) -> list[LoadResult]:
        return self._loader.poll_loads()

    # -- observations (step thread) -------------------------------------------------------

    def on_store(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        with self._lock:
            self._publisher.on_store(list(hashes), None)
            self._held.update(hashes)

    def on_evict(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        with self._lock:
            self._publisher.on_remove(list(hashes))
            self._held.difference_update(hashes)

    def on_tier_store(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._publisher.on_store(list(hashes), None, medium)
            self._tier_held[medium].update(hashes)

    def on_tier_remove(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._publisher.on_remove(list(hashes), medium)
            self._tier_held[medium].difference_update(hashes)

    def on_clear(self) -> None:
        with self._lock:
            self._publisher.on_clear()
            self._held.clear()

    # -- the publisher thread -----------------------------------------------------------------

    def _publish_loop(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(self.config.publish_interval_s):
            try:
                now = time.monotonic()
                if self._must_rejoin:
                    if now >= self._next_rejoin:
                        self._next_rejoin = now + RESOLVE_INTERVAL_S
                        with self._flush_lock:
                            self._rejoin()
                        last_beat = time.monotonic()
                    continue
                self.flush()
                if now - last_beat > self.config.heartbeat_interval_s:
                    last_beat = now
                    self._check_incarnation()
                    self._loader.refresh_directory()  # peers that left or came
            except IndexUnavailable as e:
                self._warn("publishing to the index failed: %s", e)
            except Exception:  # keep publishing whatever one round hit
                logger.exception("%s: the publisher thread failed a round", self.worker_id)

    def _check_incarnation(self) -> None:
        """Heartbeat; another incarnation (a restarted index) or None (purged): rejoin."""
        incarnation = self._call("heartbeat", self.worker_id, self._token)
        if incarnation is None or incarnation != self._incarnation:
            self._note_loss()

    def flush(self) -> int:
        """Send every buffered batch now; returns how many. Sends a snapshot on a gap.

        Callable from any thread; one batch is in flight at a time (the index applies a
        worker's batches in sequence order, and a threaded actor may reorder concurrent calls).
        Never raises for the index: while it is down (or a rejoin is under way) this returns 0
        and the buffer waits; the rejoin's snapshot then covers it. A batch lost on the way
        costs a gap and a snapshot, never half-applied state.
        """
        if self._must_rejoin or not self._flush_lock.acquire(timeout=self.config.timeout_s):
            return 0
        try:
            return self._flush()
        finally:
            self._flush_lock.release()

    def _flush(self) -> int:
        sent = 0
        try:
            while not self._must_rejoin:
                with self._lock:
                    batch = self._publisher.drain()
                if batch is None:
                    break
                result = self._call("apply", batch, self._token)
                sent += 1
                self.stats["batches_sent"] += 1
                if result == "gap":
                    self._send_snapshot()
                elif result == "rejected":  # unknown worker: purged, or a new index
                    self._check_incarnation()
                    if self._must_rejoin:
                        self._rejoin()
        except IndexUnavailable as e:
            self._warn("flushing to the index failed: %s", e)
        return sent

    def _rejoin(self) -> None:
        """Register again (the index is new, or forgot us) and send a snapshot; the caller
        holds the flush lock. Raises IndexUnavailable, with the rejoin still due."""
        losses = self._losses
        self._register()
        blocks = self._send_snapshot(reset=True)
        self.stats["rejoins"] += 1
        with self._resolve_lock:
            if self._losses == losses:  # else the index failed again meanwhile: once more
                self._must_rejoin = False
        logger.warning(
            "%s: rejoined the index (incarnation %s) with a snapshot of %d blocks",
            self.worker_id,
            self._incarnation,
            blocks,
        )

    def _send_snapshot(self, reset: bool = False) -> int:
        """Send every held hash (the pool's, and the tiers'); returns how many in the pool."""
        with self._lock:
            # After a rejoin the snapshot already holds what is buffered: drop the buffer.
            next_seq = self._publisher.reset_for_snapshot() if reset else self._publisher.next_seq
            hashes = list(self._held)
            tiers = {m: list(held) for m, held in self._tier_held.items()}
        self._call("apply_snapshot", self.worker_id, hashes, next_seq, self._token, tiers)
        self.stats["snapshots_sent"] += 1
        return len(hashes)

    def confirm_pending(self, pending_id: int, hashes: Sequence[BlockHash]) -> bool:
        """Sends the index's ``confirm_pending`` with this worker's token, and does not wait
        for it: a slow or dead index must not hold a thread per request, and a confirmation
        lost only shortens the entry's life (routing quality, no more)."""
        try:
            args = (self.worker_id, pending_id, list(hashes), self._token)
            self.index.confirm_pending.remote(*args)
            return True
        except Exception as e:
            self._warn("confirming pending entry %s failed: %s", pending_id, e)
            return False

    def get_stats(self) -> dict[str, float]:
        """This connector's counters and its transport's (``known_peers``: the peers a plan
        may name); never asks the index."""
        known = {"known_peers": len(self._loader.directory)}
        return {**self.stats, **self.transport.get_stats(), **known}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._loader.close(self.config.timeout_s)
        if not self._must_rejoin:  # else the index does not know us: nothing to take back
            self.flush()
            try:
                self._call("deregister", self.worker_id, self._token)
            except Exception as e:
                logger.warning("%s: deregistering failed: %s", self.worker_id, e)
        self.transport.close()
