"""Pulling a prefix's KV from a peer against computing it, and against a plain memcpy.

Two worker actors (real Ray, the chosen transport). Worker A computes a prompt whose first
N tokens are the prefix (compute TTFT); worker B then gets the same prompt and pulls the
prefix's blocks from A (pull TTFT), then gets it twice more as a local hit: right away (its
KV warm in cache) and after the CPU caches were flushed (its KV from memory, as after the
pull). A plain torch memcpy of the same bytes runs in this process for scale. Prints one
JSON line.

    .venv/bin/python bench/pull_vs_recompute.py --model smollm2-135m --prefix-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import random
import time

import ray
import torch

from kvmesh import SamplingParams
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.worker_actor import worker_actor_class


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best / 1e9


def evict_caches(nbytes: int = 1 << 30) -> None:
    """Push every CPU cache level's lines out (L3 is shared by the socket's cores): write then
    read more bytes than any cache holds."""
    buf = torch.ones(nbytes // 4)
    float(buf.sum())


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=8)
    ap.add_argument("--transport", default="nixl", choices=["nixl", "ray"])
    ap.add_argument("--kv-cache-memory", default="512MiB")
    args = ap.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory, progress=False)
    # A long pull on a slow box; the lease must outlast the read (the config checks it).
    conn = ClusterConnectorConfig(transport=args.transport, timeout_s=30.0, lease_s=30.0)
    cls = worker_actor_class(num_gpus=0, num_cpus=1)
    # Each worker gets both cores while it computes: the two never compute at the same time.
    a, b = (cls.remote(f"bench-{n}", cfg, conn, num_threads=2) for n in "ab")
    info = ray.get([a.ready.remote(), b.ready.remote()])[0]
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prefix_tokens + args.suffix_tokens)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=1)
    ray.get([a.generate.remote([5, 6, 7], warm), b.generate.remote([5, 6, 7], warm)])
    # One small pull first: the NIXL handshake (once per peer pair) is not part of a TTFT.
    handshake = [rng.randrange(1000, 40000) for _ in range(4 * info["block_size"] + 1)]
    ray.get(a.generate.remote(handshake, warm))
    ray.get(a.flush_events.remote())
    ray.get(b.generate.remote(handshake, warm))
    base = ray.get(b.connector_stats.remote())

    computed = ray.get(a.generate.remote(prompt, params))
    ray.get(a.flush_events.remote())
    pulled = ray.get(b.generate.remote(prompt, params))
    stats = ray.get(b.connector_stats.remote())
    # The same prompt once more on B: a local hit, so its TTFT is the suffix's compute alone.
    again = ray.get(b.generate.remote(prompt, params))
    # Once more with this machine's caches flushed first: its KV (and the weights) come from
    # memory, as the pulled request's did after the transfer wrote them; a large shared L3
    # (300 MiB on some servers) holds the whole prefix for the warm local hit above.
    evict_caches()
    cold = ray.get(b.generate.remote(prompt, params))
    stats = {k: stats[k] - base[k] for k in ("pulled_bytes", "pull_s")}
    result = {
        "bench": "pull_vs_recompute",
        "model": args.model,
        "transport": args.transport,
        "prefix_tokens": args.prefix_tokens,
        "prompt_tokens": len(prompt),
        "compute_ttft_s": round(computed.metrics.ttft_s, 4),
        "pull_ttft_s": round(pulled.metrics.ttft_s, 4),
        # arrival -> scheduled covers lookup, pin and transfer; scheduled -> token the compute.
        "pull_schedule_s": round(
            pulled.metrics.first_scheduled_time - pulled.metrics.arrival_time, 4
        ),
        "local_hit_ttft_s": round(again.metrics.ttft_s, 4),
        "local_hit_cold_ttft_s": round(cold.metrics.ttft_s, 4),
        "ttft_speedup": round(computed.metrics.ttft_s / pulled.metrics.ttft_s, 1),
        "pulled_tokens": pulled.metrics.num_pulled_tokens,
        "outputs_equal": computed.token_ids == pulled.token_ids,
        "pulled_mb": round(stats["pulled_bytes"] / 1e6, 1),
        "pull_s": round(stats["pull_s"], 4),
        "pull_gbps": round(stats["pulled_bytes"] / max(stats["pull_s"], 1e-9) / 1e9, 2),
        "memcpy_gbps": round(memcpy_gbps(int(stats["pulled_bytes"]) or 1), 2),
        "block_size": info["block_size"],
    }
    print(json.dumps(result))
    ray.shutdown()


if __name__ == "__main__":
    main()
