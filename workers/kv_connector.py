"""The KV cache connector seam: how a worker's block pool reaches KV outside itself.

The KV cache manager calls a connector at these points, and nowhere else, all on the step
thread (the thread that owns the pool). None of them may wait on the network: a connector
that talks to peers does that on threads of its own.

1. After the local prefix lookup stops at block k: ``lookup(hashes[k:], plan)`` says how many
   more blocks (a prefix of ``hashes[k:]``) the connector can supply, or None: "not known yet,
   ask again at a later step" (it started a query of its own; the request waits meanwhile
   and other requests run). ``plan`` is the cluster router's ``PullPlan`` for the request,
   relative to ``hashes``, when one came with it; it is passed only when there is one.
   What ``lookup`` may keep: answers to the queries it started (keyed by the hashes asked
   about), as a cache it may drop at any time; a local tier may keep the blocks it found from
   its own eviction until the load starts (or the next ``lookup``). Nothing a load needs: a
   load never depends on an earlier ``lookup``, and the manager may never start one (the
   pool may be too full).
2. The manager allocates that many fresh local blocks and calls ``start_load(load_id, hashes,
   block_ids, plan)``. The manager picks the block ids (fresh, held by this request only), so
   a connector can never hand back ids of blocks it did not fill. Either the load completes
   inside the call (a ``LoadResult``, e.g. a local tier: the default calls ``load``), or it
   runs in the background (None) and ``poll_loads`` reports it later, exactly once.
3. ``poll_loads()`` (every step): the ``LoadResult``s of background loads that ended. A result
   says how many leading blocks were filled with the right KV; only those are registered and
   counted as a hit, and the tokens of the rest are computed into the same blocks (never
   wrong KV). A result is final: nothing writes those blocks afterwards. Except a result
   with ``writing=True``: the load failed but a transfer into its blocks could not be
   stopped; the manager keeps those blocks out of use (quarantined; the request gets others)
   until a later result for the same ``load_id`` comes with ``writing=False``.
4. ``on_hit``, ``on_store``, ``on_evict``, ``on_clear``: observations, after the fact.
   ``on_evict`` comes before the evicted blocks are reused: their bytes can still be read
   (the local tiers copy them out then, ``tiered_connector.py``).
5. ``on_tier_store`` / ``on_tier_remove``: blocks entered or left a local tier ("host",
   "disk"), from any thread; a connector that tells an index passes them on.
6. A peer's pin of blocks the pool lacks but local tiers hold: ``promote`` copies them into
   fresh blocks. Blocks kept only on disk (``disk_only``) are read first, off the step
   thread, by ``stage`` (the worker pins in two calls then), so the step thread copies
   memory only.

A request whose load is in flight can be aborted: its blocks stay allocated until the load's
result comes, so no transfer ever writes into a block that was handed to someone else.

The cluster connector (``kvmesh.connector``) implements this seam over the cluster index and
a transport; ``workers/`` only knows this interface. The cluster layer itself calls only the
named methods ``flush``, ``get_stats``, ``lookup`` (through ``WorkerActor.peer_blocks``) and
``close``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.workers.block_hash import BlockHash

if TYPE_CHECKING:
    import torch

BlockReader = Callable[[int], bytes]
"""Returns the KV bytes of a local block id."""
BlockBytes = bytes | memoryview
"""A block's KV bytes as ``BlockReader`` gives them, or a buffer of them (the tiers')."""
BlockWriter = Callable[[int, "BlockBytes | torch.Tensor"], None]
"""Writes KV bytes (or a host uint8 tensor of them) into a local block id."""


@dataclass(frozen=True)
class PullPlan:
    """The cluster router's decision about where a request's prefix comes from.

    ``holder`` (a worker id) holds the first ``depth`` blocks of the block-hash chain it is
    given with; None: the router planned no pull. A connector uses it unless it is stale
    (the holder is not among the peers it knows, or refuses the pin), and then looks the
    index up itself.
    """

    holder: str | None
    depth: int = 0

    def __post_init__(self) -> None:
        if self.holder is not None and not isinstance(self.holder, str):
            raise ValueError(f"pull_plan.holder: must be a worker id or None, got {self.holder!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 0:
            raise ValueError(f"pull_plan.depth: must be an integer >= 0, got {self.depth!r}")

    def after(self, num_blocks: int) -> PullPlan:
        """The same plan for the chain without its first ``num_blocks`` blocks."""
        return PullPlan(self.holder, max(0, self.depth - num_blocks))


LOAD_MEDIA = ("peer", "host", "disk")


@dataclass(frozen=True)
class LoadResult:
    """How a load ended: ``num_blocks`` leading blocks filled with the right KV (0: failed).

    ``writing``: failed, and a transfer may still write its blocks; a later result for the
    same ``load_id`` with ``writing=False`` says it has stopped. ``medium``: where the blocks
    came from: a peer's pool (pulled), or this worker's host or disk tier (the slowest read);
    ``disk_blocks``: of a tier load's blocks, those read from disk (the rest: host memory).
    ``read_blocks`` / ``read_s``: the peer reads this load made, failed ones included (blocks
    asked for, seconds in the transport): what the router learns a pull's cost from;
    ``read_from``: the peer they all read from (None: none, or more than one), whose link
    that cost is.
    """

    load_id: int
    num_blocks: int
    writing: bool = False
    medium: str = "peer"
    disk_blocks: int = 0
    read_blocks: int = 0
    read_s: float = 0.0
    read_from: str | None = None


class KvCacheConnector(ABC):
    """A source of KV blocks beyond the local pool, plus observer of the pool's changes."""

    @abstractmethod
    def lookup(self, hashes: Sequence[BlockHash], plan: PullPlan | None = None) -> int | None:
        """How many blocks, from the start of ``hashes``, this connector could load; None
        while it does not know yet (ask again at a later step). Never waits on the network.

        A hint: the load may fill fewer. Keeps nothing a load depends on (see the module).
        """

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        """A synchronous fill (the default ``start_load`` calls it): local blocks
        ``block_ids[i]`` get the KV of ``hashes[i]``, all or nothing.

        Returns True only when every block was filled with the right bytes. On False (or an
        exception) the blocks are not registered and the tokens are computed into them; what
        was partly written is overwritten then, so it is never read.
        """
        return False

    def start_load(
        self,
        load_id: int,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        plan: PullPlan | None = None,
    ) -> LoadResult | None:
        """Fill ``block_ids[i]`` with the KV of ``hashes[i]`` (a leading run of them at least).

        Returns the result when the load completed inside this call, or None when it runs in
        the background: then ``poll_loads`` reports it once it ended. Never waits on the
        network. An exception counts as a result of 0 blocks.
        """
        return LoadResult(load_id, len(hashes) if self.load(hashes, block_ids) else 0)

    def poll_loads(self) -> list[LoadResult]:
        """Results of background loads that ended since the last call (see the module)."""
        return []

    def promote(
        self,
        hashes: Sequence[BlockHash],
        allocate: Callable[[int], list[int]],
        staged: Mapping[BlockHash, BlockBytes] | None = None,
    ) -> list[int]:
        """Bring all of ``hashes``, which local tiers hold, back into the pool now, for a peer
        about to pin them, or none: find their bytes (host memory, or ``staged`` for blocks
        kept only on disk), ``allocate(n)`` fresh block ids (which may evict, and so demote,
        other blocks: those must not overwrite the bytes found) and copy them in; returns
        those ids, in order (the caller registers them), or [] when any is missing. Memory
        copies only: never a disk, a peer or the network (the step thread calls it).
        Default: nothing to promote.
        """
        return []

    def disk_only(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Those of ``hashes`` that a local tier keeps only on disk: ``promote`` takes them
        from ``staged`` bytes, which ``stage`` reads. Step thread. Default: none."""
        return []

    def stage(self, hashes: Sequence[BlockHash]) -> dict[BlockHash, BlockBytes]:
        """Read the disk copies of ``hashes`` (checked; a torn or missing one left out), for a
        ``promote`` that follows. Any thread but the step thread: it reads files. Default:
        nothing."""
        return {}

    def attach(self, wake: Callable[[], None]) -> None:
        """Called once by the worker that owns this connector: call ``wake`` (from any
        thread) when a lookup's answer or a load's result is ready, so an idle step thread
        picks it up at once."""

    def on_hit(self, request_id: str, num_local_blocks: int, num_loaded_blocks: int) -> None:
        """A request's prefix was served: blocks found locally and blocks loaded.

        Called after the allocation succeeded and the load, if any, ended.
        """

    def on_store(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Full blocks were computed (or loaded) and registered in the local prefix cache."""

    def on_evict(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Cached blocks are evicted from the local pool: ``block_ids`` are about to be
        reused, and still hold the KV of ``hashes`` during this call."""

    def on_tier_store(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        """Blocks entered a local tier (``medium``: "host" or "disk"). Any thread."""

    def on_tier_remove(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        """Blocks left a local tier. Any thread."""

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

    def confirm_pending(self, pending_id: int, hashes: Sequence[BlockHash]) -> bool:
        """A request reached this worker with a router's pending entry (``pending_id``: "this
        worker computes these blocks now") for a prompt whose block hashes are ``hashes``:
        vouch for the entry, which until then is believed only briefly. True when the
        confirmation went out. Any thread but the step thread; never blocks on a peer, never
        raises. Default: nothing to confirm (False)."""
        return False

    def on_stop(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """The worker stops, its step thread ended: the pool's cached blocks, least recently
        used first, which hold the KV of ``hashes`` during this call. A connector that keeps
        blocks across a restart keeps these (the tiered one writes them to its disk tier,
        with its host tier's). Called once, right before ``close``."""

    def close(self) -> None:
        """The worker is shutting down: flush, deregister, release resources."""


class NoopKvCacheConnector(KvCacheConnector):
    """The default: supplies nothing, observes nothing. Behaviour equals no connector."""

    def lookup(self, hashes: Sequence[BlockHash], plan: PullPlan | None = None) -> int:
        return 0


class InMemoryKvCacheConnector(KvCacheConnector):
    """A process-local store of block payloads keyed by hash: an external KV tier in miniature.

    Every stored block's bytes are copied out through ``reader``; ``load`` copies them back
    through ``writer``, synchronously (through the default ``start_load``). Evicting a block
    locally leaves its copy here, so a later request gets it back through ``load`` instead of
    computing it. ``capacity`` bounds the store (LRU).
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

    def lookup(self, hashes: Sequence[BlockHash], plan: PullPlan | None = None) -> int:
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

    def on_evict(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self.stats["evicted_blocks"] += len(hashes)

    def on_clear(self) -> None:
        self.stats["clears"] += 1
