"""Block transport micro benchmark: pull 2048 tokens of smollm2-135m KV between two actors.

Two Ray actors (separate processes) each own a float32 KV cache shaped like smollm2-135m's
(30 layers, 3 KV heads, head_dim 64, block_size 16) with 128 blocks (~94 MB). The puller
pulls all 128 blocks in one `read_blocks` call, timed inside the puller (best of --repeat).
"nixl" pulls blocks 0..127 into 0..127 (NIXL merges the runs; here into one descriptor);
"nixl_scattered" pulls them in a shuffled order (7680 separate 6 KiB descriptors). The
baseline, "memcpy_gbps", is a torch `copy_` of the same bytes inside the puller actor,
interleaved with the pulls so that both see the same load (Ray actors run torch with one
thread, as CMA, UCX's intra-node copy, is one thread). NixlTransport moves CPU caches onto
huge pages, which speeds up CMA; "nixl_4k" is the same pull with `huge_pages=False`.
Prints one JSON line.

    .venv/bin/python bench/transport.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import ray
import torch

from kvmesh.connector.nixl_transport import NixlTransport
from kvmesh.connector.transport import BlockTransport, make_transport
from kvmesh.workers.kv_cache import KVCache

SHAPE = (30, 2, 128, 16, 3, 64)  # [layers, K/V, blocks, block_size, kv heads, head_dim]
NUM_BLOCKS = SHAPE[2]


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, transport: str, worker_id: str) -> None:
        cache = KVCache(torch.randn(SHAPE))
        self.transport: BlockTransport
        if transport == "nixl_4k":
            self.transport = NixlTransport(worker_id, cache, "bench", huge_pages=False)
        else:
            self.transport = make_transport(transport, worker_id, cache, "bench")

    def info(self) -> bytes:
        return self.transport.local_info()

    def add_peer(self, info: bytes, handle: Any) -> str:
        return self.transport.add_peer(info, handle)

    def export_blocks(self, lease_id: Any, block_ids: list[int]) -> Any:
        return self.transport.export_blocks(block_ids)  # a stand-in holder: no leases here

    def checksum(self) -> float:
        return float(self.transport.kv_cache.data.double().sum())

    def pull(
        self, peer: str, remote: list[int], local: list[int], repeat: int
    ) -> tuple[float, float]:
        """Best seconds over `repeat` pulls, and over as many interleaved memcpys."""
        src, scratch = self.transport.kv_cache.data, torch.randn(SHAPE)
        pull_s = memcpy_s = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            self.transport.read_blocks(peer, remote, local, 60.0)
            pull_s = min(pull_s, time.perf_counter() - t)
            t = time.perf_counter()
            scratch.copy_(src)
            memcpy_s = min(memcpy_s, time.perf_counter() - t)
        return pull_s, memcpy_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    nbytes = torch.empty(SHAPE).nbytes
    ids = list(range(NUM_BLOCKS))
    shuffled = random.Random(0).sample(ids, NUM_BLOCKS)
    result: dict[str, Any] = {"bytes": nbytes}
    memcpy_best = float("inf")
    runs = [("nixl", "nixl", ids), ("nixl_scattered", "nixl", shuffled)]
    runs += [("nixl_4k", "nixl_4k", ids), ("ray", "ray", ids)]
    for name, transport, remote in runs:
        holder = Worker.remote(transport, f"holder-{name}")
        puller = Worker.remote(transport, f"puller-{name}")
        peer = ray.get(puller.add_peer.remote(ray.get(holder.info.remote()), holder))
        seconds, memcpy_s = ray.get(puller.pull.remote(peer, remote, ids, args.repeat))
        memcpy_best = min(memcpy_best, memcpy_s)
        # Same multiset of blocks either way, so the sums agree when the copy is complete.
        sums = ray.get([holder.checksum.remote(), puller.checksum.remote()])
        assert abs(sums[0] - sums[1]) < 1e-6 * max(1.0, abs(sums[0])), (name, sums)
        result[name] = round(nbytes / seconds / 1e9, 2)
        for actor in (holder, puller):
            ray.kill(actor)
    result["memcpy_gbps"] = round(nbytes / memcpy_best / 1e9, 2)
    print(json.dumps(result))
    ray.shutdown()


if __name__ == "__main__":
    main()
