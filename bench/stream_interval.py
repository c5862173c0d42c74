"""What a stream's messages cost: the same load with ``stream_interval_s`` 0 and with the
default, side by side in one run.

The Serve app (tiny-random, ``--workers`` workers, a local Ray) serves ``--requests``
concurrent greedy completions of ``--max-tokens`` tokens through the official ``openai``
client, every other one streamed (the chaos suite's traffic, ``tests/two_hosts_client.py``).
For each interval: the load's wall seconds, the CPU seconds of every Ray process (engines,
worker replicas, ingress, proxy, GCS, raylet) and of this client, chunks per streamed
request, TTFT p50 / p99 as the client sees it, and whether every answer equals the first
interval's. One JSON line.

    cd bench && ../.venv/bin/python stream_interval.py [--intervals 0,0.05] [--max-tokens 300]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stats import percentile

from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_app import deploy
from tests.ports import free_port
from tests.two_hosts_client import complete, streamed, wait_ready


def ray_cpu_s() -> collections.Counter[str]:
    """CPU seconds of this process's descendants (the local Ray's processes) by process
    title (``ray::WorkerActor``, ``ray::ServeReplica:kvmesh:KvmeshServer``, ``raylet``)."""
    total: collections.Counter[str] = collections.Counter()
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            name = p.cmdline()[0].split(".")[0] if p.cmdline() else p.name()
            total[os.path.basename(name)] += t.user + t.system
        except (psutil.Error, IndexError):
            continue
    return total


STREAMS = {"every-other": streamed, "all": lambda i: True, "none": lambda i: False}


def run(
    config: ServeConfig, texts: list[str], max_tokens: int, streams: Callable[[int], bool]
) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{config.port}"
    deploy(config)
    assert wait_ready(base_url, model=config.model_name)["ready"]
    ray_before, me = ray_cpu_s(), psutil.Process()
    mine = me.cpu_times()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        outs = list(
            pool.map(
                lambda it: complete(base_url, it[1], max_tokens, streams(it[0]), config.model_name),
                enumerate(texts),
            )
        )
    seconds = time.perf_counter() - start
    failed = [o for o in outs if not o["ok"]]
    assert not failed, failed[:3]
    client_cpu = sum(me.cpu_times()[:2]) - sum(mine[:2])
    used = ray_cpu_s()
    used.subtract(ray_before)
    streamed_outs = [o for o in outs if "chunks" in o]
    ttfts = [o["ttft_s"] for o in streamed_outs if o["ttft_s"] is not None]
    return {
        "seconds": round(seconds, 2),
        "ray_cpu_s": round(sum(used.values()), 1),
        "ray_cpu_s_by_process": {k: round(v, 1) for k, v in used.most_common() if v >= 0.5},
        "client_cpu_s": round(client_cpu, 1),
        "chunks_per_stream": round(statistics.mean(o["chunks"] for o in streamed_outs), 1)
        if streamed_outs
        else None,
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3) if ttfts else None,
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3) if ttfts else None,
        "texts": [o["text"] for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals", default="0,0.05", help="stream_interval_s values, in order")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--stream", choices=list(STREAMS), default="every-other")
    args = ap.parse_args()
    texts = [f"request {i}: " + " ".join(f"w{i}x{j}" for j in range(24)) for i in range(64)]
    texts = (texts * (args.requests // len(texts) + 1))[: args.requests]
    ray.init(
        address="local",
        num_cpus=args.workers + 1,
        include_dashboard=False,
        log_to_driver=False,
    )
    port = free_port()  # one Serve proxy for every run
    rows: dict[str, Any] = {}
    try:
        for interval in [float(x) for x in args.intervals.split(",")]:
            config = ServeConfig(
                model=args.model,
                workers=args.workers,
                kv_cache_memory="64MiB",
                num_cpus_per_worker=1.0,
                port=port,
                stream_interval_s=interval,
            )
            rows[f"{interval:g}"] = run(config, texts, args.max_tokens, STREAMS[args.stream])
            serve.delete("kvmesh")
    finally:
        serve.shutdown()
        ray.shutdown()
    first = next(iter(rows.values()))["texts"]
    for row in rows.values():
        row["same_texts"] = row.pop("texts") == first
    print(
        json.dumps(
            {
                "bench": "stream_interval",
                "model": args.model,
                "workers": args.workers,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "stream": args.stream,
                "by_interval_s": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
