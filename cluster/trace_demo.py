"""A synthetic multi-request trace through one worker's block pool, with no model.

Conversations share a system prompt and grow turn by turn; the pool is small, so blocks get
evicted, and an in-memory connector (an external KV tier in miniature) brings them back.
Used by ``kvmesh demo --synthetic``; it needs neither torch nor Ray.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvmesh.workers.kv_cache_manager import KVCacheManager
from kvmesh.workers.kv_connector import InMemoryKvCacheConnector
from kvmesh.workers.request import Request


@dataclass(frozen=True)
class TraceConfig:
    num_conversations: int = 4
    turns: int = 3
    system_prompt_tokens: int = 48
    turn_tokens: int = 20
    answer_tokens: int = 12
    block_size: int = 8
    num_blocks: int = 40
    seed: int = 0


def run_trace(cfg: TraceConfig, out=print) -> dict[str, int]:
    """Run the trace, print one line per request, return the totals."""
    rng = random.Random(cfg.seed)
    memory: dict[int, bytes] = {}
    connector = InMemoryKvCacheConnector(memory.__getitem__, memory.__setitem__)
    manager = KVCacheManager(cfg.num_blocks, cfg.block_size, connector=connector)
    system = [rng.randrange(1000) for _ in range(cfg.system_prompt_tokens)]
    histories = {c: list(system) for c in range(cfg.num_conversations)}
    totals = {"requests": 0, "prompt_tokens": 0, "local_hit_tokens": 0, "loaded_tokens": 0}
    out(f"{'request':>9} {'prompt':>6} {'local':>6} {'loaded':>6} {'computed':>8} {'evicted':>7}")
    for turn in range(cfg.turns):
        for conv, history in histories.items():
            history.extend(rng.randrange(1000) for _ in range(cfg.turn_tokens))
            req = Request(f"c{conv}t{turn}", history, cfg.block_size, b"synthetic-model")
            evicted_before = manager.pool.num_evictions
            computed = manager.get_computed_blocks(req)
            hit = (len(computed.local_blocks) + computed.num_external_blocks) * cfg.block_size
            alloc = manager.allocate_slots(req, req.num_tokens - hit, computed)
            assert alloc is not None, "the trace is sized to fit the pool"
            # "Compute" the rest: the KV of a block stands in as its hash.
            ids = manager.get_block_ids(req)
            for i in range(alloc.num_kv_tokens // cfg.block_size, len(req.block_hashes)):
                memory[ids[i]] = req.block_hashes[i]
            req.num_kv_tokens = req.num_tokens
            manager.cache_blocks(req, req.num_tokens)
            manager.free(req)
            manager.check_integrity()
            history.extend(rng.randrange(1000) for _ in range(cfg.answer_tokens))
            computed_tokens = req.num_tokens - alloc.num_kv_tokens
            evicted = manager.pool.num_evictions - evicted_before
            out(
                f"{req.request_id:>9} {req.num_tokens:>6} {alloc.num_local_hit_tokens:>6} "
                f"{alloc.num_loaded_tokens:>6} {computed_tokens:>8} {evicted:>7}"
            )
            totals["requests"] += 1
            totals["prompt_tokens"] += req.num_tokens
            totals["local_hit_tokens"] += alloc.num_local_hit_tokens
            totals["loaded_tokens"] += alloc.num_loaded_tokens
    totals["evictions"] = manager.pool.num_evictions
    totals.update({f"connector_{k}": v for k, v in connector.stats.items()})
    out("totals: " + ", ".join(f"{k}={v}" for k, v in totals.items()))
    return totals
