"""The KV cache manager: which blocks each request holds, prefix hits, and the connector seam.

The scheduler drives it in this order for a request that holds no blocks yet:

    computed = manager.get_computed_blocks(request)        # local prefix + connector lookup
    alloc = manager.allocate_slots(request, n, computed)   # all or nothing; loads via connector
    ... the model writes the new tokens' KV ...
    manager.cache_blocks(request, request.num_computed_tokens)
    ...
    manager.free(request)                                  # done or preempted

and later steps call ``allocate_slots(request, n)`` without ``computed``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.block_pool import BlockPool, KVBlock
from kvmesh.workers.kv_connector import KvCacheConnector, NoopKvCacheConnector
from kvmesh.workers.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ComputedBlocks:
    """The result of a prefix lookup: local hits, then blocks the connector says it has."""

    local_blocks: tuple[KVBlock, ...] = ()
    num_external_blocks: int = 0


@dataclass(frozen=True)
class Allocation:
    """What ``allocate_slots`` did. Token counts are multiples of the block size."""

    new_blocks: tuple[KVBlock, ...]  # blocks to compute into (loaded blocks excluded)
    num_local_hit_tokens: int = 0
    num_loaded_tokens: int = 0

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the request holds before this step computes anything."""
        return self.num_local_hit_tokens + self.num_loaded_tokens


class RequestTooLargeError(ValueError):
    """The request's tokens can never fit in the pool, however empty it gets."""


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

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

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

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of a request that holds no blocks, then the connector's part.

        The last token is always left to compute, so the step has logits to sample from.
        Nothing is allocated or referenced here.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks()
        hashes = request.block_hashes
        max_blocks = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        local: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            local.append(block)
        rest = hashes[len(local) : max_blocks]
        n_ext = max(0, min(len(rest), self.connector.lookup(rest))) if rest else 0
        return ComputedBlocks(tuple(local), n_ext)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> Allocation | None:
        """Give the request blocks for ``num_new_tokens`` more tokens; None if they do not fit.

        ``num_new_tokens`` counts tokens after what the request already holds (after the
        ``computed`` prefix on its first allocation). All or nothing: on None nothing changed.
        With ``computed``, the local hits are referenced and the connector's blocks are
        allocated and loaded; after a failed load those blocks are returned in ``new_blocks``
        with the rest, and their tokens must be computed.
        """
        computed = computed or ComputedBlocks()
        held = self.req_to_blocks.get(request.request_id, [])
        if computed.local_blocks or computed.num_external_blocks:
            assert not held, "a prefix hit is only applied to a request that holds no blocks"
        bs = self.block_size
        n_local, n_ext = len(computed.local_blocks), computed.num_external_blocks
        num_tokens = request.num_computed_tokens + (n_local + n_ext) * bs + num_new_tokens
        self.check_fits(num_tokens)
        num_new_blocks = max(0, cdiv(num_tokens, bs) - len(held) - n_local)
        # Hits on free cached blocks take them out of the free queue before we pop from it.
        num_free_hits = sum(1 for b in computed.local_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None

        self.req_to_blocks[request.request_id] = held
        self.pool.touch(computed.local_blocks)
        held.extend(computed.local_blocks)
        # Every block is taken before the load: a connector that waits inside ``load`` may let
        # peers pin our cached blocks meanwhile, and that must not starve this allocation.
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        num_loaded = self._load_external(request, new_blocks[:n_ext], n_local) if n_ext else 0
        if n_local or num_loaded:
            self.num_cached_blocks[request.request_id] = n_local + num_loaded
            self.connector.on_hit(request.request_id, n_local, num_loaded)
        return Allocation(tuple(new_blocks[num_loaded:]), n_local * bs, num_loaded * bs)

    def _load_external(self, request: Request, blocks: list[KVBlock], start: int) -> int:
        """Have the connector fill ``blocks`` (fresh, this request's); blocks loaded (0 or all).

        On failure the blocks stay with the request, unregistered: their tokens are computed
        into them, overwriting whatever the failed load wrote.
        """
        n = len(blocks)
        hashes = request.block_hashes[start : start + n]
        try:
            ok = self.connector.load(hashes, [b.block_id for b in blocks])
        except Exception:
            logger.exception("connector load of %d blocks failed; computing them", n)
            ok = False
        if not ok:
            return 0
        self._register(hashes, blocks)
        return n

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full with computed KV."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes))
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
        """Release a finished or preempted request's blocks, tail first (evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
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
        self.pool.check_integrity()
        held = sum(len(b) for b in self.req_to_blocks.values())
        refs = sum(b.ref_cnt for b in self.pool.blocks)
        assert held == refs, f"requests hold {held} block refs, pool counts {refs}"
