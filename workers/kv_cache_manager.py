"""The KV cache manager: which blocks each request holds, prefix hits, and the connector seam.

The scheduler drives it in this order for a request that holds no blocks yet:

    computed = manager.get_computed_blocks(request)        # local prefix + connector lookup
    alloc = manager.allocate_slots(request, n, computed)   # all or nothing; starts a load
    ... when alloc.num_loading_tokens: the request waits; each step, poll_loads() says
        which loads ended (their blocks registered, or left to compute) ...
    ... the model writes the new tokens' KV ...
    manager.cache_blocks(request, request.num_kv_tokens)
    ...
    manager.free(request)                                  # done, preempted or aborted

and later steps call ``allocate_slots(request, n)`` without ``computed``.

Who holds a reference on a block: requests (``req_to_blocks``), loads whose request was freed
while they ran (their blocks wait for the load to end), quarantined loads (a transfer that
could not be stopped may still write them) and peers' leases (``pins``: workers/kv_pins.py).
``check_integrity`` counts all four.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.block_pool import BlockPool, KVBlock
from kvmesh.workers.kv_allocation import (
    Allocation,
    ComputedBlocks,
    LoadOutcome,
    RequestTooLargeError,
)
from kvmesh.workers.kv_connector import (
    KvCacheConnector,
    LoadResult,
    NoopKvCacheConnector,
    PullPlan,
)
from kvmesh.workers.kv_pins import Pins
from kvmesh.workers.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Load:
    """A background load: its request and the fresh blocks it fills."""

    request: Request
    blocks: list[KVBlock]
    start: int  # the chain index of blocks[0]
    num_local_blocks: int
    # Set when the request was freed while the load ran: all of its blocks, freed at the end.
    orphaned: list[KVBlock] | None = None


class KVCacheManager:
    """Owns the block pool for one worker and each request's block table."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        connector: KvCacheConnector | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.connector = connector or NoopKvCacheConnector()
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, on_evict=self.connector.on_evict)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's leading blocks have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self._load_ids = itertools.count()
        self.loads: dict[int, _Load] = {}  # background loads in flight, by load id
        self.loading: dict[str, int] = {}  # request id -> its load id
        self.quarantine: dict[int, list[KVBlock]] = {}  # load id -> blocks a transfer may write
        self.pins = Pins(self.pool, self.connector, self._register)  # peers' leases

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def awaits_connector(self) -> bool:
        """Background loads in flight (a request's, or one whose request is gone) or blocks
        in quarantine: ``poll_loads`` has results still to come."""
        return bool(self.loads or self.quarantine)

    def cached_blocks(self) -> list[KVBlock]:
        """Every block of the prefix cache, least recently used first: the free ones in
        eviction order, then those in use."""
        pool = self.pool
        free = [pool.blocks[i] for i in pool.free_queue.block_ids()]
        in_use = [b for b in pool.cached.values() if b.ref_cnt]
        return [b for b in free if b.block_hash is not None] + in_use

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the local prefix cache."""
        return list(self.pool.cached)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one request can ever hold."""
        return self.pool.num_blocks * self.block_size

    def check_fits(self, num_tokens: int) -> None:
        """Raise RequestTooLargeError when ``num_tokens`` can never fit in the pool."""
        if num_tokens > self.max_num_tokens:
            raise RequestTooLargeError(
                f"request needs {num_tokens} tokens of KV cache but the pool holds at most "
                f"{self.max_num_tokens} ({self.pool.num_blocks} blocks of {self.block_size}); "
                "shorten the prompt or max_tokens, or give the worker more KV cache memory"
            )

    def get_computed_blocks(self, request: Request) -> ComputedBlocks | None:
        """Longest cached prefix of a request that holds no blocks, then the connector's part;
        None while the connector does not know yet (ask again at a later step).

        The last token is always left to compute, so the step has logits to sample from.
        Nothing is allocated or referenced here.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logits:
            return ComputedBlocks()  # its blocks are still cached for others when computed
        hashes = request.block_hashes
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        local: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            local.append(block)
        rest = hashes[len(local) : max_blocks]
        if not rest or not request.may_pull:
            return ComputedBlocks(tuple(local))
        plan = self._plan(request, len(local))
        # Connectors written before plans take no second argument: pass one only if it came.
        n_ext = self.connector.lookup(rest) if plan is None else self.connector.lookup(rest, plan)
        if n_ext is None:
            return None
        return ComputedBlocks(tuple(local), max(0, min(len(rest), n_ext)))

    @staticmethod
    def _plan(request: Request, num_local_blocks: int) -> PullPlan | None:
        """The request's plan, for the chain after its local hits."""
        plan = request.pull_plan
        return plan.after(num_local_blocks) if plan is not None else None

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> Allocation | None:
        """Give the request blocks for ``num_new_tokens`` more tokens; None if they do not fit.

        ``num_new_tokens`` counts tokens after what the request already holds (after the
        ``computed`` prefix on its first allocation). All or nothing: on None nothing changed.
        With ``computed``, the local hits are referenced and the connector's blocks are
        allocated and their load started. A load that completed at once is applied here (after
        a failed one those blocks are returned in ``new_blocks`` with the rest, and their
        tokens must be computed); one in the background shows as ``num_loading_tokens``.
        """
        computed = computed or ComputedBlocks()
        held = self.req_to_blocks.get(request.request_id, [])
        if computed.local_blocks or computed.num_external_blocks:
            assert not held, "a prefix hit is only applied to a request that holds no blocks"
        bs = self.block_size
        n_local, n_ext = len(computed.local_blocks), computed.num_external_blocks
        num_tokens = request.num_kv_tokens + (n_local + n_ext) * bs + num_new_tokens
        self.check_fits(num_tokens)
        num_new_blocks = max(0, cdiv(num_tokens, bs) - len(held) - n_local)
        # Hits on free cached blocks take them out of the free queue before we pop from it.
        num_free_hits = sum(1 for b in computed.local_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None

        self.req_to_blocks[request.request_id] = held
        self.pool.touch(computed.local_blocks)
        held.extend(computed.local_blocks)
        # Every block is taken before the load starts: it writes only blocks this request holds.
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        if not n_ext:
            if n_local:
                self.num_cached_blocks[request.request_id] = n_local
                self.connector.on_hit(request.request_id, n_local, 0)
            return Allocation(tuple(new_blocks), n_local * bs)
        result = self._start_load(request, new_blocks[:n_ext], n_local)
        if result is None:  # in the background: the request waits for ``poll_loads``
            return Allocation(tuple(new_blocks[n_ext:]), n_local * bs, 0, n_ext * bs)
        num_loaded = self._loaded(request, new_blocks[:n_ext], n_local, result)
        self.num_cached_blocks[request.request_id] = n_local + num_loaded
        if n_local or num_loaded:
            self.connector.on_hit(request.request_id, n_local, num_loaded)
        return Allocation(
            tuple(new_blocks[num_loaded:]),
            n_local * bs,
            num_loaded * bs,
            loaded_medium=result.medium,
            loaded_disk_tokens=min(result.disk_blocks, num_loaded) * bs,
        )

    def _start_load(self, request: Request, blocks: list[KVBlock], start: int) -> LoadResult | None:
        """Have the connector fill ``blocks`` (fresh, this request's): its result when it
        completed at once, else None (then the load is tracked until ``poll_loads``)."""
        load_id = next(self._load_ids)
        hashes = request.block_hashes[start : start + len(blocks)]
        plan = self._plan(request, start)
        ids = [b.block_id for b in blocks]
        try:
            result = self.connector.start_load(load_id, hashes, ids, plan)
        except Exception:
            logger.exception("connector load of %d blocks failed; computing them", len(blocks))
            return LoadResult(load_id, 0)
        if result is None:
            self.loads[load_id] = _Load(request, blocks, start, start)
            self.loading[request.request_id] = load_id
        return result

    def _loaded(self, request: Request, blocks: list[KVBlock], start: int, r: LoadResult) -> int:
        """Register the leading blocks a load filled; how many. The others stay with the
        request, unregistered: their tokens are computed into them, overwriting whatever the
        load wrote."""
        n = 0 if r.writing else max(0, min(r.num_blocks, len(blocks)))
        if n:
            self._register(request.block_hashes[start : start + n], blocks[:n])
        return n

    def poll_loads(self) -> list[LoadOutcome]:
        """Background loads that ended, for requests still here (see ``LoadOutcome``)."""
        out: list[LoadOutcome] = []
        for result in self.connector.poll_loads():
            if not result.writing and result.load_id in self.quarantine:
                # The transfer has stopped: its blocks hold nothing, reuse them first.
                self.pool.free_blocks(self.quarantine.pop(result.load_id), front=True)
                continue
            load = self.loads.pop(result.load_id, None)
            if load is None:
                logger.warning("connector reported an unknown load %d", result.load_id)
                continue
            n = self._loaded(load.request, load.blocks, load.start, result)
            if load.orphaned is not None:  # the request is gone: its blocks can go now
                self._release(load.orphaned, load.blocks if result.writing else [], result)
                continue
            rid = load.request.request_id
            del self.loading[rid]
            reads = {
                "read_blocks": result.read_blocks,
                "read_s": result.read_s,
                "read_from": result.read_from,
            }
            if result.writing:
                blocks = self.req_to_blocks.pop(rid)
                self.num_cached_blocks.pop(rid, None)
                self._release(blocks, load.blocks, result)
                load.request.may_pull = False
                out.append(LoadOutcome(load.request, 0, restart=True, **reads))
                continue
            self.num_cached_blocks[rid] = load.num_local_blocks + n
            if load.num_local_blocks or n:
                self.connector.on_hit(rid, load.num_local_blocks, n)
            loaded = n * self.block_size
            disk = min(result.disk_blocks, n) * self.block_size
            out.append(
                LoadOutcome(load.request, loaded, medium=result.medium, disk_tokens=disk, **reads)
            )
        return out

    def _release(self, blocks: list[KVBlock], busy: list[KVBlock], result: LoadResult) -> None:
        """Free ``blocks`` tail first, except ``busy`` ones: a transfer may still write
        those, so they are quarantined until the connector says it stopped."""
        if busy:
            logger.warning(
                "a failed load's transfer is still running: %d blocks quarantined", len(busy)
            )
            self.quarantine[result.load_id] = busy
        kept = set(busy)  # blocks compare by identity
        self.pool.free_blocks([b for b in blocks[::-1] if b not in kept])

    def cache_blocks(self, request: Request, num_kv_tokens: int) -> None:
        """Register the request's blocks that became full with computed KV."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_kv_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        blocks = self.req_to_blocks[rid][start:end]
        self._register(request.block_hashes[start:end], blocks)
        self.num_cached_blocks[rid] = end

    def _register(self, hashes: list[BlockHash], blocks: list[KVBlock]) -> None:
        pairs = zip(hashes, blocks, strict=True)
        stored = [(h, b.block_id) for h, b in pairs if self.pool.cache_block(b, h)]
        if stored:
            self.connector.on_store([h for h, _ in stored], [i for _, i in stored])

    def free(self, request: Request) -> None:
        """Release a finished, preempted or aborted request's blocks, tail first (evicted
        first). While its load runs they stay allocated, and are freed when it ends."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        load_id = self.loading.pop(request.request_id, None)
        if load_id is not None:
            self.loads[load_id].orphaned = blocks
            return
        self.pool.free_blocks(blocks[::-1])

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while a request holds blocks."""
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.connector.on_clear()
        return ok

    def check_integrity(self) -> None:
        """The pool's invariants, and every reference accounted for: requests, loads whose
        request is gone, quarantined blocks and leases."""
        self.pool.check_integrity()
        held = sum(len(b) for b in self.req_to_blocks.values())
        orphaned = sum(len(ld.orphaned or ()) for ld in self.loads.values())
        quarantined = sum(len(b) for b in self.quarantine.values())
        pinned = self.pins.num_refs
        refs = sum(b.ref_cnt for b in self.pool.blocks)
        assert held + orphaned + quarantined + pinned == refs, (
            f"requests hold {held} block refs, finishing loads {orphaned}, quarantine "
            f"{quarantined}, leases {pinned}; the pool counts {refs}"
        )
        assert set(self.loading) <= set(self.req_to_blocks), "a loading request holds no blocks"
