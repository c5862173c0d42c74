"""Block transports: copy whole KV blocks from a peer worker's KV cache into local blocks.

A transport belongs to one worker and its `KVCache`. Peers introduce themselves once per pair
with `local_info()` bytes (sent through Ray); `add_peer` checks that the peer computes the same
KV (model fingerprint id) in the same layout, then `read_blocks` pulls blocks in one transfer.
Two implementations: NIXL `READ` straight from the peer's registered KV memory
(`nixl_transport.py`), and a fallback through the Ray object store (`ray_transport.py`).

A block here is all layers, K and V: the bytes `KVCache.read_block` returns.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import numpy as np

from kvmesh.workers.kv_cache import KVCache

if TYPE_CHECKING:
    from kvmesh.connector.transfer_faults import TransferFaults

logger = logging.getLogger(__name__)


class TransferError(Exception):
    """A pull failed (unknown peer, bad block id, peer gone, timeout, size mismatch). The
    caller frees the local blocks it passed and recomputes; their content is undefined."""


class TransferInFlight(TransferError):
    """A read failed (timed out, or NIXL would not release it) and may still be running:
    the local blocks may still be written. ``is_over()`` checks without waiting; once it
    returns True the transfer's handle is released and nothing writes those blocks any more.
    Until then they must not be reused."""

    def __init__(self, message: str, is_over: Callable[[], bool]) -> None:
        super().__init__(message)
        self.is_over = is_over


class PeerRefused(ValueError):
    """A peer computes different KV (fingerprint id) or lays it out differently."""


@dataclass(frozen=True)
class CacheLayout:
    """What must match between two caches for their blocks to be interchangeable.

    `shape` is `KVCache.data`'s [num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]; everything but num_blocks must match.
    """

    shape: tuple[int, ...]
    dtype: str
    block_nbytes: int

    @classmethod
    def of(cls, kv_cache: KVCache) -> CacheLayout:
        return cls(tuple(kv_cache.data.shape), str(kv_cache.dtype), kv_cache.block_nbytes)

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    def compatible(self, other: CacheLayout) -> bool:
        without_blocks = (self.shape[:2] + self.shape[3:], self.dtype, self.block_nbytes)
        return without_blocks == (
            other.shape[:2] + other.shape[3:],
            other.dtype,
            other.block_nbytes,
        )

    def describe(self) -> str:
        return f"shape={list(self.shape)} dtype={self.dtype} block_nbytes={self.block_nbytes}"


@dataclass(frozen=True)
class PeerInfo:
    """A decoded `local_info()`: `meta` is the transport's own part."""

    worker_id: str
    fingerprint_id: str
    transport: str
    layout: CacheLayout
    meta: dict[str, Any]


class BlockTransport(ABC):
    """Moves whole KV blocks from peers' caches into this worker's cache.

    One instance per worker, used from one thread (the worker actor's). Reads are one-sided:
    the holder does nothing per pull (NIXL) or only serves `export_blocks` (Ray); keeping the
    holder's blocks alive for the duration (pinning under a lease) is the caller's business,
    and the caller passes that lease's id to `read_blocks` (the Ray transport's holder serves
    only blocks under a live lease the caller names).
    """

    name: ClassVar[str]

    def __init__(self, worker_id: str, kv_cache: KVCache, fingerprint_id: str) -> None:
        self.worker_id = worker_id
        self.kv_cache = kv_cache
        self.fingerprint_id = fingerprint_id
        self.layout = CacheLayout.of(kv_cache)
        self._peers: dict[str, PeerInfo] = {}
        self._peer_raw: dict[str, bytes] = {}

    def local_info(self) -> bytes:
        """msgpack bytes a peer passes to its `add_peer`: worker id, fingerprint id, transport
        name, cache layout and the transport's metadata (NIXL: agent metadata, base address)."""
        return msgpack.packb(
            {
                "worker_id": self.worker_id,
                "fingerprint_id": self.fingerprint_id,
                "transport": self.name,
                "shape": list(self.layout.shape),
                "dtype": self.layout.dtype,
                "block_nbytes": self.layout.block_nbytes,
                "meta": self._local_meta(),
            }
        )

    def add_peer(self, info: bytes, handle: Any = None) -> str:
        """Connect to the peer described by its `local_info()`; returns its worker id.

        Idempotent: the same info again is a no-op; new info under a known worker id (the
        peer restarted) replaces the old connection. `handle` is the peer worker's Ray actor
        handle (needed by the Ray transport, ignored by NIXL). Raises PeerRefused, naming
        both sides, when the fingerprint id, transport or layout (all but num_blocks) differ.
        """
        d = msgpack.unpackb(info)
        peer = PeerInfo(
            worker_id=d["worker_id"],
            fingerprint_id=d["fingerprint_id"],
            transport=d["transport"],
            layout=CacheLayout(tuple(d["shape"]), d["dtype"], d["block_nbytes"]),
            meta=d["meta"],
        )
        if peer.fingerprint_id != self.fingerprint_id:
            raise PeerRefused(
                f"peer {peer.worker_id} has fingerprint id {peer.fingerprint_id!r}, "
                f"{self.worker_id} has {self.fingerprint_id!r}"
            )
        if peer.transport != self.name:
            raise PeerRefused(
                f"peer {peer.worker_id} uses transport {peer.transport!r}, "
                f"{self.worker_id} uses {self.name!r}"
            )
        if not peer.layout.compatible(self.layout):
            raise PeerRefused(
                f"peer {peer.worker_id} has KV layout {peer.layout.describe()}, "
                f"{self.worker_id} has {self.layout.describe()} (only num_blocks may differ)"
            )
        if self._peer_raw.get(peer.worker_id) == info:
            return peer.worker_id
        if peer.worker_id in self._peers:
            self.remove_peer(peer.worker_id)
        self._connect(peer, handle)
        self._peers[peer.worker_id] = peer
        self._peer_raw[peer.worker_id] = info
        return peer.worker_id

    @abstractmethod
    def read_blocks(
        self,
        peer_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float,
        lease_id: str | None = None,
    ) -> int:
        """Copy the peer's blocks `remote_block_ids[i]` into local `local_block_ids[i]`, all in
        one transfer, within `timeout_s`; returns the bytes moved. `lease_id`: the holder's
        lease on those blocks (`Worker.pin`); the Ray transport's holder refuses reads without
        it, NIXL ignores it.

        Raises TransferError on any failure: unknown peer, lists of different lengths, a block
        id out of range on either side, a repeated local id, the peer gone, an error state, the
        timeout. All or nothing from the caller's view: after an error the local blocks'
        content is undefined (the caller frees them). Other local blocks are never touched.
        """

    def remove_peer(self, peer_id: str) -> None:
        """Forget a peer and release what was set up for it; unknown ids are a no-op."""
        if self._peers.pop(peer_id, None) is not None:
            self._peer_raw.pop(peer_id, None)
            self._disconnect(peer_id)

    def close(self) -> None:
        """Remove all peers and release the transport's resources. Idempotent."""
        for peer_id in list(self._peers):
            self.remove_peer(peer_id)

    def get_stats(self) -> dict[str, float]:
        """Counters the connector adds to its own `get_stats` (none here; faults' counts)."""
        return {}

    def export_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """Holder side: `KVCache.export_blocks`, unchecked (a worker actor's `export_blocks`
        checks the caller's lease first: never expose this one to peers as is)."""
        return self.kv_cache.export_blocks(block_ids)

    def _peer(self, peer_id: str) -> PeerInfo:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(f"{self.worker_id}: unknown peer {peer_id!r}")
        return peer

    def _check_ids(
        self, peer: PeerInfo, remote_ids: Sequence[int], local_ids: Sequence[int]
    ) -> None:
        """Raise TransferError for mismatched lengths, out-of-range or repeated local ids."""
        if len(remote_ids) != len(local_ids):
            raise TransferError(
                f"{len(remote_ids)} remote block ids but {len(local_ids)} local ones"
            )
        for side, ids, n in (
            (f"peer {peer.worker_id}", remote_ids, peer.layout.num_blocks),
            (self.worker_id, local_ids, self.layout.num_blocks),
        ):
            bad = [b for b in ids if not 0 <= b < n]
            if bad:
                raise TransferError(f"block ids {bad} out of range [0, {n}) on {side}")
        if len(set(local_ids)) != len(local_ids):
            raise TransferError(f"repeated local block ids in {list(local_ids)}")

    def _local_meta(self) -> dict[str, Any]:
        """The transport's part of `local_info()`."""
        return {}

    @abstractmethod
    def _connect(self, peer: PeerInfo, handle: Any) -> None:
        """Set up what reads from `peer` need (called once per peer, after the checks)."""

    @abstractmethod
    def _disconnect(self, peer_id: str) -> None:
        """Undo `_connect`."""


def make_transport(
    name: str | None,
    worker_id: str,
    kv_cache: KVCache,
    fingerprint_id: str,
    faults: TransferFaults | None = None,
) -> BlockTransport:
    """ "nixl", "ray", or None: NIXL when it imports and an agent can be created, else Ray.
    Raises ValueError for any other name.

    Test/bench hook: with `faults`, or else the `KVMESH_FAULT_TRANSPORT` environment variable
    (parsed only here), the transport is wrapped in a `FaultyTransport` (fault_transport.py).
    """
    from kvmesh.connector.fault_transport import FaultyTransport
    from kvmesh.connector.transfer_faults import TransferFaults

    faults = faults if faults is not None else TransferFaults.from_env()  # bad spec: raise now
    transport = _make_transport(name, worker_id, kv_cache, fingerprint_id)
    return transport if faults is None else FaultyTransport(transport, faults)


def _make_transport(
    name: str | None, worker_id: str, kv_cache: KVCache, fingerprint_id: str
) -> BlockTransport:
    from kvmesh.connector.nixl_transport import NixlTransport
    from kvmesh.connector.ray_transport import RayTransport

    if name == "nixl":
        return NixlTransport(worker_id, kv_cache, fingerprint_id)
    if name == "ray":
        return RayTransport(worker_id, kv_cache, fingerprint_id)
    if name is not None:
        raise ValueError(f"unknown transport {name!r} (expected 'nixl', 'ray' or None)")
    try:
        return NixlTransport(worker_id, kv_cache, fingerprint_id)
    except Exception as e:  # no nixl, no UCX plugin, registration refused: all mean "use Ray"
        logger.warning("NIXL unavailable (%s: %s); using the Ray transport", type(e).__name__, e)
        return RayTransport(worker_id, kv_cache, fingerprint_id)
