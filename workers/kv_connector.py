"""The KV cache connector seam: how a worker's block pool reaches KV outside itself.

The KV cache manager calls a connector at these points, and nowhere else:

1. After the local prefix lookup stops at block k: ``lookup(hashes[k:])`` says how many more
   blocks (a prefix of ``hashes[k:]``) the connector can supply. Side-effect free.
2. The manager allocates that many fresh local blocks and calls ``load(hashes, block_ids)``
   to fill them. Only when it succeeds are the blocks registered and counted as a hit; on
   failure they are not registered and those tokens are computed into them. The manager picks
   the block ids, so a connector can never hand back ids of blocks it did not fill.
3. ``on_hit``, ``on_store``, ``on_evict``, ``on_clear``: observations, after the fact.

The cluster connector (``kvmesh.connector``) implements this seam over the cluster index and
a transport; ``workers/`` only knows this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvmesh.workers.block_hash import BlockHash

BlockReader = Callable[[int], bytes]
"""Returns the KV bytes of a local block id."""
BlockWriter = Callable[[int, bytes], None]
"""Writes KV bytes into a local block id."""


class KvCacheConnector(ABC):
    """A source of KV blocks beyond the local pool, plus observer of the pool's changes."""

    @abstractmethod
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many blocks, from the start of ``hashes``, this connector could load.

        Must not change any state that ``load`` depends on: it is a hint, and the manager may
        never call ``load`` after it (the pool may be too full).
        """

    @abstractmethod
    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        """Fill local blocks ``block_ids[i]`` with the KV of ``hashes[i]``, all or nothing.

        Returns True only when every block was filled with the right bytes. On False (or an
        exception) the blocks are not registered and the tokens are computed into them; what
        was partly written is overwritten then, so it is never read.

        A connector that blocks here (waiting on a peer) must call the ``service`` function
        given to ``attach`` while it waits, so peers pulling from this worker make progress.
        """

    def attach(self, service: Callable[[], None]) -> None:
        """Called once by the worker that owns this connector; see ``load``."""

    def on_hit(self, request_id: str, num_local_blocks: int, num_loaded_blocks: int) -> None:
        """A request's prefix was served: blocks found locally and blocks loaded by ``load``.

        Called after the allocation succeeded (and the load, when there was one).
        """

    def on_store(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Full blocks were computed (or loaded) and registered in the local prefix cache."""

    def on_evict(self, hashes: Sequence[BlockHash]) -> None:
        """Cached blocks were evicted from the local pool (their ids are being reused)."""

    def on_clear(self) -> None:
        """The local prefix cache was reset."""

    def flush(self) -> int:
        """Publish what was observed so far now (e.g. a prompt's blocks, for a peer waiting
        to pull them); returns how many batches went out. Callable from any thread; never
        raises for an unreachable peer."""
        return 0

    def get_stats(self) -> dict[str, float]:
        """Cumulative counters (pulls, bytes, failures, seconds); no remote call."""
        return {}

    def close(self) -> None:
        """The worker is shutting down: flush, deregister, release resources."""


class NoopKvCacheConnector(KvCacheConnector):
    """The default: supplies nothing, observes nothing. Behaviour equals no connector."""

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return 0

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        return False


class InMemoryKvCacheConnector(KvCacheConnector):
    """A process-local store of block payloads keyed by hash: an external KV tier in miniature.

    Every stored block's bytes are copied out through ``reader``; ``load`` copies them back
    through ``writer``. Evicting a block locally leaves its copy here, so a later request gets
    it back through ``load`` instead of computing it. ``capacity`` bounds the store (LRU).
    """

    def __init__(
        self, reader: BlockReader, writer: BlockWriter, capacity: int | None = None
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.capacity = capacity
        self.store: OrderedDict[BlockHash, bytes] = OrderedDict()
        self.stats = {
            "lookups": 0,
            "loads": 0,
            "loaded_blocks": 0,
            "stored_blocks": 0,
            "evicted_blocks": 0,
            "hits_local": 0,
            "hits_loaded": 0,
            "clears": 0,
        }

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        self.stats["lookups"] += 1
        n = 0
        for h in hashes:
            if h not in self.store:
                break
            n += 1
        return n

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        if len(hashes) != len(block_ids):
            return False
        payloads = [self.store.get(h) for h in hashes]
        if any(p is None for p in payloads):
            return False
        for block_id, payload in zip(block_ids, payloads, strict=True):
            assert payload is not None
            self.writer(block_id, payload)
        for h in hashes:
            self.store.move_to_end(h)
        self.stats["loads"] += 1
        self.stats["loaded_blocks"] += len(hashes)
        return True

    def on_hit(self, request_id: str, num_local_blocks: int, num_loaded_blocks: int) -> None:
        self.stats["hits_local"] += num_local_blocks
        self.stats["hits_loaded"] += num_loaded_blocks

    def on_store(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        for h, block_id in zip(hashes, block_ids, strict=True):
            self.store[h] = self.reader(block_id)
            self.store.move_to_end(h)
        self.stats["stored_blocks"] += len(hashes)
        while self.capacity is not None and len(self.store) > self.capacity:
            self.store.popitem(last=False)

    def on_evict(self, hashes: Sequence[BlockHash]) -> None:
        self.stats["evicted_blocks"] += len(hashes)

    def on_clear(self) -> None:
        self.stats["clears"] += 1
