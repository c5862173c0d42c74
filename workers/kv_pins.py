"""Peers' pins on a worker's cached blocks: the blocks a peer reads over NIXL, held for it.

``PeerLeases`` (workers/peer_leases.py) decides whether a peer may pin (lease ids, caps,
expiry); this holds the blocks. A pin holds a reference on each block, so the pool never
reuses one a peer is reading. Blocks the pool lacks but the connector's tiers hold (a tail,
or a hole: the pool evicts a chain's tail first, and a conversation's later turns come back)
are promoted into fresh blocks first (``KvCacheConnector.promote``) and registered, so a peer
can pull what a worker keeps in host memory or on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.block_pool import BlockPool, KVBlock
from kvmesh.workers.kv_connector import BlockBytes, KvCacheConnector

# Registers blocks filled with the KV of these hashes in the prefix cache (and tells the
# connector): the manager's, so a promotion registers as a computed block does.
Register = Callable[[list[BlockHash], list[KVBlock]], None]


class Pins:
    """The blocks each lease holds, by lease id."""

    def __init__(self, pool: BlockPool, connector: KvCacheConnector, register: Register) -> None:
        self.pool = pool
        self.connector = connector
        self.register = register
        self.leases: dict[str, list[KVBlock]] = {}  # lease id -> blocks a peer reads

    def __len__(self) -> int:
        return len(self.leases)

    @property
    def num_refs(self) -> int:
        """The block references leases hold (``KVCacheManager.check_integrity``)."""
        return sum(len(b) for b in self.leases.values())

    def pin(
        self,
        lease_id: str,
        hashes: list[BlockHash],
        staged: Mapping[BlockHash, BlockBytes] | None = None,
    ) -> list[int] | None:
        """Hold the cached blocks of ``hashes`` under ``lease_id``; their ids, or None
        (nothing held) when any hash is not cached here. Blocks kept only in the tiers are
        promoted first; those kept only on disk come from ``staged`` (see :meth:`to_stage`).
        """
        if lease_id in self.leases or len(set(hashes)) != len(hashes):  # a chain never repeats
            return None
        blocks = [self.pool.get_cached_block(h) for h in hashes]
        cached = [b for b in blocks if b is not None]
        self.pool.touch(cached)  # before promoting: its allocations must not evict them
        missing = [h for h, b in zip(hashes, blocks, strict=True) if b is None]
        if missing:
            promoted = self._promote(missing, staged)
            if promoted is None:
                self.pool.free_blocks(cached[::-1])
                return None
            fresh = iter(promoted)
            blocks = [b if b is not None else next(fresh) for b in blocks]
        held = [b for b in blocks if b is not None]
        self.leases[lease_id] = held
        return [b.block_id for b in held]

    def room(self, hashes: list[BlockHash], max_pinned: int, pinned: Collection[int]) -> int:
        """How many of ``hashes``, from the first, a pin can hold now: each takes a free
        block (a free cached block leaves the queue; a block the pool lacks is promoted into
        one) and, unless a lease holds it already (``pinned``: block ids), one of the
        ``max_pinned`` blocks all leases may hold together. A chain is read from its head:
        the rest is the peer's to compute."""
        free, cap = self.pool.num_free_blocks, max_pinned - len(pinned)
        for i, block_hash in enumerate(hashes):
            block = self.pool.get_cached_block(block_hash)
            free -= block is None or block.ref_cnt == 0
            cap -= block is None or block.block_id not in pinned
            if free < 0 or cap < 0:
                return i
        return len(hashes)

    def to_stage(
        self, hashes: list[BlockHash], staged: Mapping[BlockHash, BlockBytes]
    ) -> list[BlockHash]:
        """The blocks a :meth:`pin` of ``hashes`` would promote from disk and ``staged`` lacks:
        the caller reads them (``KvCacheConnector.stage``) off this thread and pins again."""
        missing = [h for h in hashes if self.pool.get_cached_block(h) is None]
        return [h for h in self.connector.disk_only(missing) if h not in staged]

    def _promote(
        self, hashes: list[BlockHash], staged: Mapping[BlockHash, BlockBytes] | None
    ) -> list[KVBlock] | None:
        """The connector's tier copies of all of ``hashes``, in fresh registered blocks (one
        reference each, the pin's); None, and nothing kept, when it lacks any of them."""
        n = len(hashes)
        new: list[KVBlock] = []

        def allocate(k: int) -> list[int]:
            new.extend(self.pool.get_new_blocks(k))  # k <= n <= free (checked below)
            return [b.block_id for b in new]

        fits = n <= self.pool.num_free_blocks
        ids = self.connector.promote(hashes, allocate, staged) if fits else []
        if len(ids) < n:
            self.pool.free_blocks(new[::-1])
            return None
        self.register(hashes, new)
        return new

    def unpin(self, lease_id: str) -> None:
        """Drop the lease's hold on its blocks; an unknown lease is a no-op."""
        blocks = self.leases.pop(lease_id, None)
        if blocks:
            self.pool.free_blocks(blocks[::-1])
