"""``TieredKvConnector``: the local tiers (``kv_tiers.py``) in front of another connector.

Behind the seam, in the manager's order:
- ``on_evict`` (a block is about to be reused): the inner connector hears of it, then the
  tiers keep a copy of its bytes (``KvTiers.demote``).
- ``lookup``: the tiers' depth and the inner connector's answer (a peer's), the larger; None
  while the inner one does not know yet and the tiers cannot cover everything. The host
  blocks found keep their slots until ``start_load`` (``KvTiers.keep_for_load``), so the
  load's own allocation does not demote them away.
- ``start_load``: from the tiers when they hold every asked block, else from the inner
  connector. Blocks all in host memory are copied in at once (memory copies, like a step's
  own work); a load that reads disk runs on the tier loader's thread and ``poll_loads``
  reports it. A load names its slowest medium (``LoadResult.medium``) and how many of its
  blocks came from disk (``disk_blocks``; the rest from host memory). A torn or vanished
  file ends the load at that block: the leading blocks read are registered, the rest
  computed.
- ``promote`` (a peer pins blocks this worker keeps in a tier): copied back into fresh pool
  blocks, so the peer's read finds them in the pool. Blocks only on disk are read first, off
  the step thread (``disk_only`` names them, ``stage`` reads and checks them on the tier's
  reader threads), and ``promote`` takes those bytes; the pin stops before a torn file
  (``PeerLeases.grant``), and the peer computes from there.
- Everything else goes to the inner connector; tier changes reach it as ``on_tier_store`` /
  ``on_tier_remove`` (the cluster connector tells the index).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.kv_connector import (
    BlockBytes,
    BlockWriter,
    KvCacheConnector,
    LoadResult,
    PullPlan,
)
from kvmesh.workers.kv_tiers import BlockCopier, KvTiers

logger = logging.getLogger(__name__)

_Job = tuple[int, list[BlockHash], list[int]]
DISK_READERS = 4  # block files read at once: a disk's queue depth, not its one-file speed


class TieredKvConnector(KvCacheConnector):
    def __init__(
        self, inner: KvCacheConnector, tiers: KvTiers, read_into: BlockCopier, writer: BlockWriter
    ) -> None:
        """``read_into`` copies a pool block into host memory it is given (the host tier's slot:
        one copy); ``writer`` copies a block's bytes into the pool."""
        self.inner = inner
        self.tiers = tiers
        self.read_into = read_into
        self.writer = writer
        tiers.listener = self._tier_changed
        self.stats: dict[str, float] = dict.fromkeys(
            ("host_loaded_blocks", "disk_loaded_blocks", "tier_loads", "promoted_blocks"), 0
        )
        self.stats["promote_s"] = 0.0  # time in promote (reading the tier, writing the pool)
        self._wake: Callable[[], None] = lambda: None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._results: list[LoadResult] = []
        self._results_lock = threading.Lock()
        tiers.start()  # first: a disk tier it refuses leaves no thread behind
        self._readers = ThreadPoolExecutor(DISK_READERS, thread_name_prefix="kv-tier-read")
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)
        self._loader.start()

    def _tier_changed(self, medium: str, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        if stored:
            self.inner.on_tier_store(medium, stored)
        if removed:
            self.inner.on_tier_remove(medium, removed)

    def attach(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.inner.attach(wake)

    # -- lookups and loads -------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], plan: PullPlan | None = None) -> int | None:
        n_tier = self.tiers.depth(hashes)
        self.tiers.keep_for_load(hashes[:n_tier])  # until start_load, past its allocation
        if n_tier == len(hashes):
            return n_tier
        n_inner = self.inner.lookup(hashes) if plan is None else self.inner.lookup(hashes, plan)
        if n_inner is None:
            return None
        return max(n_tier, n_inner)

    def start_load(
        self,
        load_id: int,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        plan: PullPlan | None = None,
    ) -> LoadResult | None:
        media = [self.tiers.medium(h) for h in hashes]
        if None in media or "disk" in media:
            # Not copied here and now: the reader thread copies host blocks as it meets them.
            self.tiers.release()
        if None in media:  # a peer has more than the tiers: pull it all
            return self.inner.start_load(load_id, hashes, block_ids, plan)
        self.stats["tier_loads"] += 1
        if "disk" in media:
            self._jobs.put((load_id, list(hashes), list(block_ids)))
            return None
        try:
            return self._load(load_id, list(hashes), list(block_ids))
        finally:
            self.tiers.release()

    def _load(
        self, load_id: int, hashes: list[BlockHash], block_ids: list[int], from_disk: bool = False
    ) -> LoadResult:
        """Copy the tiers' blocks in, in order, up to the first one they cannot give. Disk
        reads run ``DISK_READERS`` at a time, ahead of the copies."""
        media = [self.tiers.medium(h) for h in hashes]
        # Off the step thread, copies (a demotion may reuse a slot); on it, the slots themselves.
        reads = (
            self._readers.map(self.tiers.read, hashes)
            if from_disk
            else map(self.tiers.memory_view, hashes)
        )
        n = 0
        for block_id, medium, payload in zip(block_ids, media, reads, strict=True):
            if payload is None:
                break
            self.writer(block_id, payload)
            self.stats[f"{medium}_loaded_blocks"] += 1
            n += 1
        disk = media[:n].count("disk")
        return LoadResult(load_id, n, medium="disk" if disk else "host", disk_blocks=disk)

    def promote(
        self,
        hashes: Sequence[BlockHash],
        allocate: Callable[[int], list[int]],
        staged: Mapping[BlockHash, BlockBytes] | None = None,
    ) -> list[int]:
        """All of ``hashes`` from host memory or ``staged`` disk copies into fresh blocks, or
        none (see the seam). The host blocks' slots are held while the pool allocates (which
        may demote other blocks into the host tier), so each block is copied once, from its
        slot into the pool, as a host load is."""
        started = time.perf_counter()
        staged = staged or {}
        with self.tiers.holding(hashes) as views:
            payloads = [
                v if v is not None else staged.get(h) for h, v in zip(hashes, views, strict=True)
            ]
            if any(p is None for p in payloads):  # not staged, or left the tiers since
                return []
            block_ids = allocate(len(payloads))
            for block_id, payload in zip(block_ids, payloads, strict=True):
                self.writer(block_id, payload)
        # The same copy as a load from the host tier: routers charge it at that cost.
        self.stats["promoted_blocks"] += len(block_ids)
        self.stats["promote_s"] += time.perf_counter() - started
        return block_ids

    def disk_only(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        return [h for h in hashes if self.tiers.medium(h) == "disk"]

    def stage(self, hashes: Sequence[BlockHash]) -> dict[BlockHash, BlockBytes]:
        """The disk copies of ``hashes``, read by the tier's reader threads (checked)."""
        reads = self._readers.map(self.tiers.read, hashes)
        return {h: p for h, p in zip(hashes, reads, strict=True) if p is not None}

    def _load_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            load_id = job[0]
            try:
                result = self._load(*job, from_disk=True)
            except Exception:
                logger.exception("a tier load failed; computing its blocks")
                result = LoadResult(load_id, 0, medium="disk")
            with self._results_lock:
                self._results.append(result)
            self._wake()

    def poll_loads(self) -> list[LoadResult]:
        with self._results_lock:
            mine, self._results = self._results, []
        return mine + self.inner.poll_loads()

    # -- observations ------------------------------------------------------------------------

    def on_hit(self, request_id: str, num_local_blocks: int, num_loaded_blocks: int) -> None:
        self.inner.on_hit(request_id, num_local_blocks, num_loaded_blocks)

    def on_store(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self.inner.on_store(hashes, block_ids)

    def on_evict(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        # The tier copy is announced before the pool's loss: the index may list a block in
        # both for a moment, never in neither (a router then sends a conversation away from
        # its history and the peer computes it; seen in bench/cluster.py).
        self.tiers.demote(hashes, block_ids, self.read_into)
        self.inner.on_evict(hashes, block_ids)

    def on_clear(self) -> None:
        self.inner.on_clear()

    def flush(self) -> int:
        return self.inner.flush()

    def get_stats(self) -> dict[str, float]:
        return {**self.inner.get_stats(), **self.tiers.get_stats(), **self.stats}

    def on_stop(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self.tiers.keep_at_stop(hashes, block_ids, self.read_into)
        self.inner.on_stop(hashes, block_ids)

    def close(self) -> None:
        self._jobs.put(None)
        self._loader.join(timeout=10)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.tiers.close()
        self.inner.close()
