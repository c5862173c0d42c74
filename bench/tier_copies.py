"""The copies between the pool and the local tiers, alone: no model, no Ray.

A real ``KVCache`` of the model's shape (smollm2-135m's by default: 30 layers, 3 KV heads of
64, float32, 16-token blocks) and the engine's ``TieredKvConnector`` over ``KvTiers``:
- ``demote_ms``: the pool evicts a prefix's blocks into the host tier (``on_evict``);
- ``host_load_ms``: a load of those blocks from the host tier into fresh pool blocks
  (``start_load``, on the step thread);
- ``disk_load_ms``: the same from the disk tier's files (page cache warm: the copies and
  checks, not the disk; ``bench/tier.py`` times a cold disk);
- ``promote_ms``: a peer's pin of host-tier blocks, copied back into the pool (``promote``).
Each is the median of ``--rounds``; GB/s are the prefix's bytes over that time. One JSON line.

    .venv/bin/python bench/tier_copies.py --prefix-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.kv_connector import NoopKvCacheConnector
from kvmesh.workers.kv_tiers import KvTiers
from kvmesh.workers.model_config import ModelConfig
from kvmesh.workers.tier_config import TierConfig
from kvmesh.workers.tiered_connector import TieredKvConnector

FP = "0123456789abcdef"


def median_ms(rounds: int, before: Callable[[], None], timed: Callable[[], None]) -> float:
    times = []
    for _ in range(rounds):
        before()
        start = time.perf_counter()
        timed()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(2)
    n = args.prefix_tokens // args.block_size
    model = ModelConfig(
        vocab_size=32,
        hidden_size=args.kv_heads * args.head_dim,
        num_layers=args.layers,
        num_heads=args.kv_heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=64,
    )
    cache = KVCache.allocate(model, 2 * n, args.block_size, torch.float32, torch.device("cpu"))
    cache.data.normal_()
    nbytes = cache.block_bytes_all_layers
    hashes = [i.to_bytes(16, "little") for i in range(n)]
    src, dst = list(range(n)), list(range(n, 2 * n))

    def connector(tiers: KvTiers) -> TieredKvConnector:  # as the engine builds it
        return TieredKvConnector(
            NoopKvCacheConnector(), tiers, cache.read_block_into, cache.write_block
        )

    with tempfile.TemporaryDirectory(prefix="kvmesh-tier-copies-") as root:
        made: list[TieredKvConnector] = []

        def fresh_host_tier() -> None:  # a tier that holds none of them yet
            if made:
                made.pop().close()
            tiers = KvTiers(TierConfig(host_bytes=n * nbytes), FP, nbytes)
            made.append(connector(tiers))

        demote_ms = median_ms(args.rounds, fresh_host_tier,
                              lambda: made[0].on_evict(hashes, src))  # fmt: skip
        conn = made[0]
        host_load_ms = median_ms(args.rounds, lambda: None,
                                 lambda: conn.start_load(0, hashes, dst))  # fmt: skip
        promote_ms = median_ms(args.rounds, lambda: None,
                               lambda: conn.promote(hashes, lambda k: dst[:k]))  # fmt: skip
        assert torch.equal(cache.data[:, :, src], cache.data[:, :, dst])
        conn.close()

        disk = KvTiers(TierConfig(disk_dir=root, disk_bytes=2 * n * (nbytes + 4096)), FP, nbytes)
        dconn = connector(disk)
        dconn.on_evict(hashes, src)
        assert disk.wait_written(60)
        cache.data[:, :, dst] = 0

        def disk_load() -> None:
            dconn.start_load(1, hashes, dst)
            while not dconn.poll_loads():
                time.sleep(0.0002)

        disk_load_ms = median_ms(args.rounds, lambda: None, disk_load)
        assert torch.equal(cache.data[:, :, src], cache.data[:, :, dst])
        dconn.close()
    gb = n * nbytes / 1e9
    print(json.dumps({
        "bench": "tier_copies",
        "prefix_tokens": args.prefix_tokens,
        "bytes": n * nbytes,
        "demote_ms": round(demote_ms, 2),
        "host_load_ms": round(host_load_ms, 2),
        "promote_ms": round(promote_ms, 2),
        "disk_load_ms": round(disk_load_ms, 2),
        "demote_gbps": round(gb / demote_ms * 1e3, 2),
        "host_load_gbps": round(gb / host_load_ms * 1e3, 2),
        "promote_gbps": round(gb / promote_ms * 1e3, 2),
        "disk_load_gbps": round(gb / disk_load_ms * 1e3, 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
