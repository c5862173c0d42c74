"""A prefix loaded from the disk tier, against computing it and against pulling it from a peer.

Four worker actors (real Ray, NIXL): A computes a prompt whose first N tokens are the prefix
(compute TTFT); B pulls the prefix from A (pull TTFT); C, with a pool too small for two such
prompts and a disk tier in a temporary directory, computes the prompt, computes another one
that evicts it down to disk, and then gets the first again: its prefix comes back from disk
(disk TTFT). Before that load, the page cache of C's block files is dropped (fsync, then
POSIX_FADV_DONTNEED on those files only), so the bytes come from the disk; the same files,
dropped again, are then read plainly in this process for the disk's sequential read rate.
D, with a host-memory tier and a pool of two such prompts (a peer may pin at most half of
it), computes a third prompt and evicts it into host memory with the other two; B then pulls
that prefix from D (host pull TTFT: D promotes the blocks into its pool for B's pin). E is D
with a disk tier instead of host memory: B pulls a fourth prefix that E keeps only on disk, its
block files' page cache dropped first (disk pull TTFT: E reads and checks the files off its step
thread, then promotes them for B's pin).

    .venv/bin/python bench/tier.py --model smollm2-135m --prefix-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import ray

from kvmesh import SamplingParams
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.worker_actor import worker_actor_class


def drop_page_cache(paths: list[Path]) -> None:
    """Write back and drop these files' cached pages (no other file's)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_gbps(paths: list[Path]) -> tuple[float, int]:
    """A plain read of every file, cold: (GB/s, bytes)."""
    drop_page_cache(paths)
    start = time.perf_counter()
    nbytes = sum(len(p.read_bytes()) for p in paths)
    return nbytes / (time.perf_counter() - start) / 1e9, nbytes


def block_files(disk_dir: Path, at_least: int) -> list[Path]:
    """The disk tier's block files under ``disk_dir`` once there are ``at_least`` of them (its
    writer is asynchronous), or after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        files = sorted(disk_dir.glob("*/slot-*/*/*.kvb"))
        if len(files) >= at_least or time.monotonic() > deadline:
            return files
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=8)
    ap.add_argument("--disk-dir", help="where the disk tier goes (default: a temporary dir)")
    args = ap.parse_args()

    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    disk_dir = tempfile.mkdtemp(prefix="kvmesh-tier-", dir=args.disk_dir)
    cfg = EngineConfig(model=args.model, kv_cache_memory="512MiB", progress=False)
    blocks = -(-(args.prefix_tokens + args.suffix_tokens + 16) // cfg.block_size)
    # C's pool: one such prompt and no more, so the second evicts the first.
    tier_cfg = EngineConfig(
        model=args.model,
        num_kv_blocks=blocks,
        disk_cache_dir=disk_dir,
        disk_cache_size="2GiB",
        progress=False,
    )
    conn = ClusterConnectorConfig(transport="nixl", timeout_s=30.0, lease_s=30.0)
    cls = worker_actor_class(num_gpus=0, num_cpus=1)
    # Each worker gets both cores while it computes: they never compute at the same time.
    a, b = (cls.remote(f"tier-bench-{n}", cfg, conn, num_threads=2) for n in "ab")
    c = cls.remote("tier-bench-c", tier_cfg, None, num_threads=2)
    host_cfg = EngineConfig(
        model=args.model, num_kv_blocks=2 * blocks, host_cache_memory="512MiB", progress=False
    )
    d = cls.remote("tier-bench-d", host_cfg, conn, num_threads=2)
    disk_peer_cfg = EngineConfig(
        model=args.model,
        num_kv_blocks=2 * blocks,
        disk_cache_dir=os.path.join(disk_dir, "e"),
        disk_cache_size="2GiB",
        progress=False,
    )
    e = cls.remote("tier-bench-e", disk_peer_cfg, conn, num_threads=2)
    info = ray.get([w.ready.remote() for w in (a, b, c, d, e)])[0]
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(args.prefix_tokens + args.suffix_tokens)]

    main_prompt, evictor, host_prompt, disk_prompt = prompt(), prompt(), prompt(), prompt()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=1)
    ray.get([w.generate.remote([5, 6, 7], warm) for w in (a, b, c, d, e)])
    for holder in (a, d, e):  # B's NIXL handshake with each holder is not part of a TTFT
        handshake = [rng.randrange(1000, 40000) for _ in range(4 * info["block_size"] + 1)]
        ray.get(holder.generate.remote(handshake, warm))
        ray.get(holder.flush_events.remote())
        ray.get(b.generate.remote(handshake, warm))

    computed = ray.get(a.generate.remote(main_prompt, params))
    ray.get(a.flush_events.remote())
    pulled = ray.get(b.generate.remote(main_prompt, params))

    ray.get(c.generate.remote(main_prompt, params))
    ray.get(c.generate.remote(evictor, params))  # main_prompt's blocks go down to disk
    ray.get(c.generate.remote(evictor, params))  # (a hit: no new eviction) the writer's time
    files = block_files(Path(disk_dir), args.prefix_tokens // cfg.block_size)
    drop_page_cache(files)
    from_disk = ray.get(c.generate.remote(main_prompt, params))
    disk_read, disk_bytes = read_gbps(files)
    stats = ray.get(c.connector_stats.remote())

    host_computed = ray.get(d.generate.remote(host_prompt, params))
    for other in (evictor, main_prompt):  # host_prompt's blocks go to host memory
        ray.get(d.generate.remote(other, params))
    ray.get(d.flush_events.remote())
    from_host = ray.get(b.generate.remote(host_prompt, params))
    d_stats = ray.get(d.connector_stats.remote())

    disk_computed = ray.get(e.generate.remote(disk_prompt, params))
    for other in (evictor, main_prompt):  # disk_prompt's blocks go to E's disk
        ray.get(e.generate.remote(other, params))
    e_files = block_files(Path(disk_dir, "e"), args.prefix_tokens // cfg.block_size)
    drop_page_cache(e_files)
    ray.get(e.flush_events.remote())
    from_peer_disk = ray.get(b.generate.remote(disk_prompt, params))
    e_stats = ray.get(e.connector_stats.remote())

    m = from_disk.metrics
    block_bytes = stats["disk_bytes"] / max(stats["disk_blocks"], 1)
    loaded_bytes = m.num_disk_hit_tokens // cfg.block_size * block_bytes
    disk_gbps = loaded_bytes / max(m.kv_load_s, 1e-9) / 1e9
    result = {
        "bench": "tier",
        "model": args.model,
        "prefix_tokens": args.prefix_tokens,
        "prompt_tokens": len(main_prompt),
        "compute_ttft_s": round(computed.metrics.ttft_s, 4),
        "pull_ttft_s": round(pulled.metrics.ttft_s, 4),
        "disk_ttft_s": round(m.ttft_s, 4),
        "disk_hit_tokens": m.num_disk_hit_tokens,
        "disk_load_s": round(m.kv_load_s, 4),
        "disk_loaded_mb": round(loaded_bytes / 1e6, 1),
        "disk_gbps": round(disk_gbps, 3),
        "disk_read_gbps": round(disk_read, 3),
        "disk_read_mb": round(disk_bytes / 1e6, 1),
        "disk_share_of_read_rate": round(
            loaded_bytes / max(m.kv_load_s, 1e-9) / 1e9 / disk_read, 2
        ),
        "host_pull_ttft_s": round(from_host.metrics.ttft_s, 4),
        "host_pull_tokens": from_host.metrics.num_pulled_tokens,
        "host_promoted_blocks": d_stats["promoted_blocks"],
        # The holder's own time copying tier blocks into its pool for the pull's pin.
        "host_promote_s": round(d_stats["promote_s"], 4),
        "disk_pull_ttft_s": round(from_peer_disk.metrics.ttft_s, 4),
        "disk_pull_tokens": from_peer_disk.metrics.num_pulled_tokens,
        "disk_pull_promoted_blocks": e_stats["promoted_blocks"],
        "disk_promote_s": round(e_stats["promote_s"], 4),
        "outputs_equal": computed.token_ids == pulled.token_ids == from_disk.token_ids
        and host_computed.token_ids == from_host.token_ids
        and disk_computed.token_ids == from_peer_disk.token_ids,
        "pulled_tokens": pulled.metrics.num_pulled_tokens,
    }
    print(json.dumps(result))
    ray.shutdown()
    shutil.rmtree(disk_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
