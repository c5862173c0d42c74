"""What peers hold pinned in a worker's pool: their leases, the limits on them, and the one
way their KV bytes leave (``export``).

Peers are not trusted (any Ray driver on the cluster can call a worker actor): a lease id is
an unguessable capability (``secrets.token_hex``), ``export`` serves only blocks of a live
lease the caller names, and ``grant`` refuses (None) a lease longer than ``MAX_LEASE_S`` or
more than ``MAX_LEASES`` leases, and cuts a pin to the head of its chain that keeps all pins
within ``MAX_PINNED_FRACTION`` of the pool, so a peer cannot starve this worker's own
requests of blocks.

``grant``, ``release`` and ``expire`` run on the worker's step thread, which owns the KV
cache manager; ``export`` runs on a caller's thread. Pinned blocks are full and cached, so
no step writes them while the lease holds, and ``export`` copies under the lease lock, which
``release`` takes too, so a lease cannot end (and its blocks be reused) in the middle of a
copy.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.workers.block_hash import BlockHash

if TYPE_CHECKING:  # MAX_LEASE_S is read where torch never loads (a Serve replica's config)
    from kvmesh.workers.kv_cache import KVCache
    from kvmesh.workers.kv_cache_manager import KVCacheManager
    from kvmesh.workers.kv_connector import BlockBytes

logger = logging.getLogger(__name__)
MAX_LEASE_S = 30.0  # longest lease; a pull needs seconds at most
MAX_PINNED_FRACTION = 0.5  # at most this share of the pool pinned at once, all leases together
MAX_LEASES = 256  # live leases at once (each puller holds at most one per pull)


@dataclass
class Lease:
    expires_at: float
    block_ids: frozenset[int]  # held by the KV cache manager under the lease's id


@dataclass(frozen=True)
class ToStage:
    """``grant``'s answer when blocks are kept only on disk: read these blocks' disk copies
    (off the step thread), then ask again with them."""

    hashes: tuple[BlockHash, ...]


class PeerLeases:
    def __init__(self, worker_id: str, kv: KVCacheManager, kv_cache: KVCache) -> None:
        self.worker_id = worker_id
        self.kv = kv
        self.kv_cache = kv_cache
        self.leases: dict[str, Lease] = {}  # lease id (a secret) -> lease
        self.pinned: dict[int, int] = {}  # block id -> how many leases pin it
        # Guards leases and pinned: the step thread changes them, export reads them.
        self.lock = threading.Lock()
        self.refused = 0

    @property
    def max_pinned_blocks(self) -> int:
        """The most blocks peers may hold pinned at once, all leases together."""
        return int(self.kv.num_blocks * MAX_PINNED_FRACTION)

    def grant(
        self,
        hashes: list[BlockHash],
        lease_s: float,
        staged: dict[BlockHash, BlockBytes] | None,
    ) -> tuple[str, list[int]] | ToStage | None:
        """Pin the cached blocks of ``hashes``' longest head that the pool has room for now
        and the pin cap allows (``Pins.room``; step thread): (lease id, their block ids).
        None when that head is empty, any of it is no longer cached here, or the pin is
        refused. Blocks the pool lacks but the host tier holds are promoted into the pool
        first. Those kept only on disk: with ``staged`` None, ``ToStage`` names them (read
        them, then ask again with their copies); with ``staged`` given, the lease stops
        before the first one it lacks (a file that failed its check, or room that changed
        meanwhile)."""
        if not _valid_lease_s(lease_s) or not hashes or len(self.leases) >= MAX_LEASES:
            return self._refuse(f"{len(hashes)} blocks for {lease_s!r} s")
        hashes = hashes[: self.kv.pins.room(hashes, self.max_pinned_blocks, self.pinned)]
        need = self.kv.pins.to_stage(hashes, staged or {})
        if need and staged is None:
            return ToStage(tuple(need))
        if need:
            hashes = hashes[: hashes.index(need[0])]
        if not hashes:
            return None
        lease_id = secrets.token_hex(16)
        block_ids = self.kv.pins.pin(lease_id, hashes, staged)
        if block_ids is None:  # not all of them cached here (any more)
            return None
        ids = frozenset(block_ids)
        if len(ids.union(self.pinned)) > self.max_pinned_blocks:  # room's count is the guard
            self.kv.pins.unpin(lease_id)
            return self._refuse(f"{len(ids)} blocks ({len(self.pinned)} pinned already)")
        with self.lock:
            self.leases[lease_id] = Lease(time.monotonic() + lease_s, ids)
            for b in ids:
                self.pinned[b] = self.pinned.get(b, 0) + 1
        return lease_id, block_ids

    def _refuse(self, what: str) -> None:
        self.refused += 1
        logger.warning("%s: refused to pin %s", self.worker_id, what)
        return None

    def release(self, lease_id: str) -> None:
        """End a lease (step thread); nothing for an unknown one."""
        with self.lock:  # waits for an export of this lease's blocks to finish
            lease = self.leases.pop(lease_id, None) if isinstance(lease_id, str) else None
            if lease is None:
                return
            for b in lease.block_ids:
                if self.pinned[b] == 1:
                    del self.pinned[b]
                else:
                    self.pinned[b] -= 1
        self.kv.pins.unpin(lease_id)

    def expire(self) -> None:
        """Release the leases whose time is up (step thread)."""
        now = time.monotonic()
        for lease_id in [i for i, lease in self.leases.items() if lease.expires_at < now]:
            logger.warning("%s: lease %s... expired; releasing", self.worker_id, lease_id[:6])
            self.release(lease_id)

    def export(self, lease_id: str, block_ids: Sequence[int]) -> np.ndarray:
        """The KV bytes of blocks pinned under the live lease ``lease_id``, in order
        (`KVCache.export_blocks`).

        Raises PermissionError, and returns no bytes, for an unknown or expired lease, or a
        block id that lease does not pin.
        """
        ids = list(block_ids)
        with self.lock:  # the lease cannot end while we copy
            lease = self.leases.get(lease_id) if isinstance(lease_id, str) else None
            if lease is None or lease.expires_at < time.monotonic():
                raise PermissionError(f"{self.worker_id}: no live lease with that id")
            if not all(type(b) is int and b in lease.block_ids for b in ids):
                raise PermissionError(f"{self.worker_id}: blocks not under that lease asked for")
            return self.kv_cache.export_blocks(ids)


def _valid_lease_s(lease_s: object) -> bool:
    """A lease length peers may ask for: a finite real number in (0, MAX_LEASE_S]."""
    if isinstance(lease_s, bool) or not isinstance(lease_s, int | float):
        return False
    return math.isfinite(lease_s) and 0 < lease_s <= MAX_LEASE_S
