"""Prompt tokens block pools would compute for a recorded request stream (bookkeeping only,
no model): one pool of a given size, or several that pull from each other under a placement.
Used by bench/cluster.py (the ideal pool) and bench/cluster_replay.py (placement floors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.kv_cache_manager import KVCacheManager
from kvmesh.workers.kv_connector import NoopKvCacheConnector
from kvmesh.workers.request import Request


def cached_depth(kv: KVCacheManager, hashes: Sequence[BlockHash]) -> int:
    """How many leading blocks of ``hashes`` the pool caches."""
    return next((n for n, h in enumerate(hashes) if h not in kv.pool.cached), len(hashes))


class _PeerPools(NoopKvCacheConnector):
    """Bookkeeping stand-in for the cluster connector: the longest prefix any other pool
    caches can be "pulled" (no bytes move; only the counts matter here)."""

    def __init__(self, me: int, pools: list[KVCacheManager]) -> None:
        self.me, self.pools = me, pools

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        others = (kv for i, kv in enumerate(self.pools) if i != self.me)
        return max((cached_depth(kv, hashes) for kv in others), default=0)

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        return True


def replay_computed(
    requests: list[tuple[list[int], list[int]]],
    num_blocks: int,
    block_size: int,
    route: Callable[[int, list[KVCacheManager]], int] = lambda i, pools: 0,
    num_pools: int = 1,
) -> int:
    """Prompt tokens computed when ``requests`` (prompt ids, output ids) are served one after
    another by ``num_pools`` block pools of ``num_blocks`` each, request i on pool
    ``route(i, pools)``, pulling from the other pools what they cache. Like the workers, a
    pool also caches the generated tokens' blocks. One pool: the ideal of one big cache."""
    pools: list[KVCacheManager] = []
    for i in range(num_pools):
        pools.append(KVCacheManager(num_blocks, block_size, connector=_PeerPools(i, pools)))
    computed = 0
    for i, (ids, output) in enumerate(requests):
        kv = pools[route(i, pools)]
        req = Request(f"r{i}", ids, block_size, b"replay")
        hit = kv.get_computed_blocks(req)
        n_hit = len(hit.local_blocks) + hit.num_external_blocks
        alloc = kv.allocate_slots(req, req.num_tokens - n_hit * block_size, hit)
        assert alloc is not None
        computed += req.num_tokens - alloc.num_kv_tokens
        kv.cache_blocks(req, req.num_tokens)
        for token in output[:-1]:  # the last token is sampled, never fed back
            req.append_output_token(token)
            assert kv.allocate_slots(req, 1) is not None
            kv.cache_blocks(req, req.num_tokens)
        kv.free(req)
    return computed
