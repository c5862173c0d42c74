"""Pulls off the step thread: the cluster connector's lookups and loads, on threads of their own.

``ClusterKvConnector`` hands its part of the seam (``lookup``, ``start_load``, ``poll_loads``)
to a ``PullLoader``. The step thread only reads what the loader knows and queues work; it
never waits on the index, a peer or a transfer. Two threads do the waiting:

- the lookup thread answers lookups that came without a usable plan: one index lookup per
  prefix, whose answer is kept (keyed by the first hash asked about) and served to the
  ``lookup`` calls that follow for ``ANSWER_TTL_S`` after the first one read it;
- the load thread runs loads one at a time: pin at the holder, one transport read into the
  blocks the manager gave, release. The holder is the plan's when the plan is usable (the
  holder is among the peers the index lists), else a kept answer's; when neither is, or the
  pin is refused (the plan or answer was stale), it looks the index up itself, once.
  A holder that leaves a pin unanswered (its process hung, its host cut off) is not asked
  again for ``UNANSWERED_S``: with one load at a time, each load queued behind it would
  otherwise wait out the same timeout (seen in chaos worker_hung's logs: a pull from the
  hung holder waited out its pin's 5-s timeout).

Results go back through a queue that ``poll_loads`` drains; ``wake`` tells the step thread.
A read that failed but could not be stopped (``TransferInFlight``) is reported with
``writing=True``; the load thread then watches it and reports ``writing=False`` once the
transfer is over, so the manager can reuse those blocks.

``directory``: the peers the index lists (worker id -> what ``register`` sent: transport info,
actor handle, pin cap), refreshed at every heartbeat and when a holder is missing from it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from kvmesh.connector.expiring import Expiring
from kvmesh.connector.holder_sets import nearest_holder
from kvmesh.connector.transport import BlockTransport, TransferError, TransferInFlight
from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.kv_connector import LoadResult, PullPlan

if TYPE_CHECKING:
    from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig

logger = logging.getLogger(__name__)
ANSWER_TTL_S = 1.0  # a lookup's answer serves the lookups of this long after its first read
MAX_ANSWERS = 4096  # answers kept at most (the oldest go first)
QUARANTINE_POLL_S = 0.01  # how often a transfer that could not be stopped is checked on
# How long a holder that left a pin unanswered is passed over: past the index's liveness
# bound (it drops a worker that stopped answering), short enough that one that only paused
# is asked again soon.
UNANSWERED_S = 30.0
IndexCall = Callable[..., Any]


@dataclass
class _Answer:
    last: BlockHash  # the last hash asked about: the same question only if it matches
    holder: str | None
    depth: int
    first_read: float | None = None


@dataclass(frozen=True)
class _LoadTask:
    load_id: int
    hashes: list[BlockHash]
    block_ids: list[int]
    holder: str | None  # the plan's or a kept answer's; None: look the index up


@dataclass
class _Reads:
    """One load's transport reads so far (``LoadResult.read_blocks`` / ``read_s`` /
    ``read_from``)."""

    blocks: int = 0
    seconds: float = 0.0
    holders: set[str] = field(default_factory=set)

    def add(self, holder: str, blocks: int, seconds: float) -> None:
        self.blocks += blocks
        self.seconds += seconds
        self.holders.add(holder)

    def result(self, load_id: int, num_blocks: int, writing: bool = False) -> LoadResult:
        only = next(iter(self.holders)) if len(self.holders) == 1 else None
        return LoadResult(
            load_id,
            num_blocks,
            writing=writing,
            read_blocks=self.blocks,
            read_s=self.seconds,
            read_from=only,
        )


class PullLoader:
    def __init__(
        self,
        worker_id: str,
        config: ClusterConnectorConfig,
        transport: BlockTransport,
        index_call: IndexCall,
        index_down: Callable[[], bool],
        stats: dict[str, float],
        node: str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.node = node  # the Ray node this worker is on: a peer there is the nearest
        self.config = config
        self.transport = transport  # used by the load thread only
        self._index_call = index_call  # raises on any index failure
        self._index_down = index_down
        self.stats = stats
        self._stats_lock = threading.Lock()
        self.directory: dict[str, dict[str, Any]] = {}  # replaced whole, never mutated
        self._answers: OrderedDict[BlockHash, _Answer] = OrderedDict()
        self._asking: set[BlockHash] = set()
        self._lock = threading.Lock()  # guards _answers and _asking
        self._lookups: queue.SimpleQueue[list[BlockHash] | None] = queue.SimpleQueue()
        self._loads: queue.SimpleQueue[_LoadTask | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self._quarantine: list[tuple[int, Callable[[], bool]]] = []  # load thread only
        # Holders that left a pin unanswered, passed over for a while (added by the load
        # thread, read by the step thread too).
        self._unanswered = Expiring(UNANSWERED_S)
        self.wake: Callable[[], None] = lambda: None
        self._threads = [
            threading.Thread(target=loop, name=f"{worker_id}-{name}", daemon=True)
            for name, loop in (("lookup", self._lookup_loop), ("load", self._load_loop))
        ]
        for t in self._threads:
            t.start()

    def count(self, key: str, n: float = 1) -> None:
        with self._stats_lock:
            self.stats[key] = self.stats.get(key, 0) + n

    # -- the step thread ----------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], plan: PullPlan | None) -> int | None:
        self.count("lookups")
        if plan is not None:
            if plan.holder is None or plan.depth == 0:  # the router planned no pull
                return 0
            if self._usable(plan.holder):
                return self._cap(plan.holder, min(len(hashes), plan.depth))
            self.count("stale_plans")  # the holder is gone: look for ourselves
        if self._index_down():  # never stall a request on an index that is down
            return 0
        first = hashes[0]
        with self._lock:
            answer = self._answers.get(first)
            if answer is not None and answer.last == hashes[-1]:
                now = time.monotonic()
                answer.first_read = answer.first_read or now
                if now - answer.first_read <= ANSWER_TTL_S:
                    return answer.depth
                del self._answers[first]
            if first in self._asking:
                return None
            self._asking.add(first)
        self._lookups.put(list(hashes))
        return None

    def start_load(
        self,
        load_id: int,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        plan: PullPlan | None,
    ) -> None:
        holder = None
        if plan is not None and plan.holder is not None and self._usable(plan.holder):
            holder = plan.holder
        elif hashes:
            with self._lock:
                answer = self._answers.get(hashes[0])
            if answer is not None and answer.depth >= len(hashes):
                holder = answer.holder
        self._loads.put(_LoadTask(load_id, list(hashes), list(block_ids), holder))

    def poll_loads(self) -> list[LoadResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def _usable(self, holder: str) -> bool:
        return (
            holder != self.worker_id and holder in self.directory and holder not in self._unanswered
        )

    def _cap(self, holder: str, depth: int) -> int:
        """What a pull from ``holder`` can take: its pin cap, and nothing under the minimum."""
        cap = self.directory.get(holder, {}).get("max_pin_blocks")
        if isinstance(cap, int) and not isinstance(cap, bool):
            depth = min(depth, cap)
        return depth if depth >= self.config.min_pull_blocks else 0

    # -- the lookup thread --------------------------------------------------------------------

    def _lookup_loop(self) -> None:
        while (hashes := self._lookups.get()) is not None:
            holder, depth = self._query(hashes)
            with self._lock:
                self._asking.discard(hashes[0])
                self._answers[hashes[0]] = _Answer(hashes[-1], holder, depth)
                self._answers.move_to_end(hashes[0])
                while len(self._answers) > MAX_ANSWERS:
                    self._answers.popitem(last=False)
            self.wake()

    def _query(self, hashes: list[BlockHash], exclude: str | None = None) -> tuple[str | None, int]:
        """The index's deepest holder of ``hashes`` (not ``exclude``; its pool and host tier
        count; among equals one on our node, :func:`nearest_holder`) and what we may pull
        from it; (None, 0) when none, or the index fails. Never raises."""
        if self._index_down():  # lookups queued before it went down: not one wait each
            return None, 0
        self.count("index_lookups")
        try:
            depths = self._index_call("pull_depths", hashes, self.worker_id) or {}
        except Exception as e:
            logger.warning("%s: index lookup failed (%s); computing", self.worker_id, e)
            return None, 0
        depths = {w: d for w, d in depths.items() if w != exclude and w not in self._unanswered}
        if not depths:
            return None, 0
        nodes = {w: meta.get("node") for w, meta in self.directory.items()}
        holder = nearest_holder(depths, self.node, nodes)
        assert holder is not None  # depths holds only peers with blocks to give
        if holder not in self.directory:
            self.refresh_directory()
        if not self._usable(holder):
            return None, 0
        depth = self._cap(holder, depths[holder])
        return (holder, depth) if depth else (None, 0)

    def refresh_directory(self) -> None:
        """The peers the index lists now (any thread); kept as it was if the index fails."""
        try:
            workers = self._index_call("workers")
        except Exception as e:
            logger.debug("%s: listing peers failed: %s", self.worker_id, e)
            return
        self.directory = {
            w: meta
            for w, meta in (workers or {}).items()
            if w != self.worker_id and meta.get("handle") is not None and "transport" in meta
        }

    # -- the load thread ----------------------------------------------------------------------

    def _load_loop(self) -> None:
        while True:
            try:
                task = self._loads.get(timeout=QUARANTINE_POLL_S if self._quarantine else None)
            except queue.Empty:
                self._check_quarantine()
                continue
            self._check_quarantine()
            if task is None:
                return
            self._results.put(self._load(task))
            self.wake()

    def _load(self, task: _LoadTask) -> LoadResult:
        """One load: the chosen holder, else (or when it refuses) the index's choice."""
        reads = _Reads()
        try:
            if task.holder is not None and task.holder not in self._unanswered:
                filled = self._pull(task, task.holder, len(task.hashes), reads)
                if filled:
                    return reads.result(task.load_id, filled)
            holder, depth = self._query(task.hashes, exclude=task.holder)
            if holder is None:
                return reads.result(task.load_id, 0)
            return reads.result(task.load_id, self._pull(task, holder, depth, reads))
        except TransferInFlight as e:
            logger.warning("%s: %s; its blocks wait until it is over", self.worker_id, e)
            self._quarantine.append((task.load_id, e.is_over))
            return reads.result(task.load_id, 0, writing=True)

    def _pull(self, task: _LoadTask, holder: str, n: int, reads: _Reads) -> int:
        """Pin the first ``n`` blocks at ``holder`` (it may hold fewer: the head its pool has
        room for and its pin cap allows), read them (counted in ``reads``, failed or not),
        release; blocks filled (0 on any failure). Raises TransferInFlight when the read
        could not be stopped."""
        n = min(n, len(task.hashes))
        hashes, local_ids = task.hashes[:n], task.block_ids[:n]
        try:
            handle = self._peer(holder)
            ref = handle.pin.remote(hashes, self.config.lease_s)
            try:
                lease = ray.get(ref, timeout=self.config.timeout_s)
            except ray.exceptions.GetTimeoutError:
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
                self._unanswered.add(holder)
                self.count("unanswered_pins")
                raise
            if lease is None:  # evicted since the index heard of it: a stale hint
                raise TransferError(f"{holder} refused the pin (no longer holds the blocks)")
            lease_id, remote_ids = lease
            try:
                if not 0 < len(remote_ids) <= n:
                    raise TransferError(f"{holder} pinned {len(remote_ids)} blocks")
                # The head it could hold (room to promote from its tiers, its pin cap): we
                # compute the rest.
                n, local_ids = len(remote_ids), local_ids[: len(remote_ids)]
                started = time.perf_counter()
                try:
                    nbytes = self.transport.read_blocks(
                        holder, remote_ids, local_ids, self.config.timeout_s, lease_id
                    )
                finally:  # a failed read teaches the cost of pulling too (a slow link)
                    seconds = time.perf_counter() - started
                    self.count("pull_s", seconds)
                    self.count("read_blocks", n)
                    reads.add(holder, n, seconds)
            finally:
                handle.release.remote(lease_id)  # fire and forget; expiry covers a lost call
        except Exception as e:
            self.count("pull_failures")
            logger.warning("%s: pull of %d blocks from %s failed: %s", self.worker_id, n, holder, e)
            if isinstance(e, TransferInFlight):
                raise
            return 0
        self.count("pulls")
        self.count("pulled_blocks", n)
        self.count("pulled_bytes", nbytes)
        return n

    def _peer(self, holder: str) -> Any:
        """The holder's actor handle, its transport info added (checks the fingerprint and
        layout: a refused peer raises PeerRefused)."""
        meta = self.directory.get(holder)
        if meta is None:
            self.refresh_directory()
            meta = self.directory.get(holder)
        if meta is None:
            raise TransferError(f"{holder} is not registered")
        self.transport.add_peer(meta["transport"], meta["handle"])  # a no-op once added
        return meta["handle"]

    def _check_quarantine(self) -> None:
        """Report loads whose unstoppable transfer is now over (their blocks are reusable)."""
        if not self._quarantine:
            return
        still = []
        for load_id, is_over in self._quarantine:
            if is_over():
                self._results.put(LoadResult(load_id, 0, writing=False))
                self.wake()
            else:
                still.append((load_id, is_over))
        self._quarantine = still

    def close(self, timeout_s: float) -> None:
        """Stop both threads (a load in flight may take up to ``timeout_s`` to end)."""
        self._lookups.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join(timeout=timeout_s)
