"""Failover under load: bench/cluster.py's multi-turn chat on 3 workers, one worker replica
killed every ``--kill-every`` seconds, against a no-fault run of the same workload.

Reports failed requests, outputs that differ from the no-fault run (greedy, so they must not),
goodput (correct requests per second) against the no-fault run, how many requests moved
(migrations), and seconds from each kill until Serve runs the full worker count again and the
replacement has registered with the index. One JSON line.

    .venv/bin/python bench/failover.py [--model smollm2-135m] [--kill-every 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from typing import Any

import ray
from ray import serve

from cluster import conversation_turns
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_app import APP_NAME, WORKER_DEPLOYMENT_PREFIX, deploy

REPLACE_LIMIT_S = 180.0
SYSTEM = (
    "You are kvmesh's assistant. You answer questions about serving large language models "
    "on clusters: caching, scheduling, batching and transfer of KV blocks. " * 8
)


async def conversation(handle: Any, turns: list[str], max_tokens: int) -> list[dict]:
    """One client's turns; a failed request is recorded and the conversation goes on with the
    no-fault history's shape (the question alone), so later turns are still comparable."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for question in turns:
        messages.append({"role": "user", "content": question})
        body = {"messages": list(messages), "max_tokens": max_tokens, "temperature": 0}
        try:
            res = await handle.generate.remote({**body, "ignore_eos": True})
            out.append({"ok": True, "text": res["text"], "kvmesh": res["kvmesh"]})
            messages.append({"role": "assistant", "content": res["text"]})
        except Exception as e:
            out.append({"ok": False, "error": type(e).__name__})
            messages.append({"role": "assistant", "content": ""})
    return out


async def workload(handle: Any, convs: list[list[str]], max_tokens: int) -> tuple[list, float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(conversation(handle, c, max_tokens) for c in convs))
    return results, time.perf_counter() - start


def worker_replicas() -> int:
    app = serve.status().applications[APP_NAME]
    return app.deployments[f"{WORKER_DEPLOYMENT_PREFIX}worker"].replica_states.get("RUNNING", 0)


def killer(handle: Any, every_s: float, workers: int, stop: threading.Event, log: list) -> None:
    """Kill one busy worker replica every ``every_s``; record seconds until it is replaced."""
    while not stop.wait(every_s):
        loads = handle.stats.remote().result()["workers"]
        if not loads:
            continue
        victim = max(loads, key=lambda w: (loads[w]["running"] + loads[w]["waiting"], w))
        role, replica_id = victim.split("-", 1)
        name = f"SERVE_REPLICA::{APP_NAME}#{WORKER_DEPLOYMENT_PREFIX}{role}#{replica_id}"
        try:
            ray.kill(ray.get_actor(name, namespace="serve"))
        except ValueError:
            continue
        killed = time.monotonic()
        entry: dict[str, Any] = {"victim": victim, "replace_s": None}
        log.append(entry)
        # Until replaced, even after the workload ended (bounded): replace_s is the figure.
        while time.monotonic() - killed < REPLACE_LIMIT_S:
            live = handle.stats.remote().result()["workers"]
            if victim not in live and len(live) == workers and worker_replicas() == workers:
                entry["replace_s"] = round(time.monotonic() - killed, 2)
                break
            time.sleep(0.25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="160MiB")
    ap.add_argument("--kill-every", type=float, default=20.0)
    args = ap.parse_args()

    convs = [conversation_turns(i, args.turns) for i in range(args.conversations)]
    ray.init(
        address="local", num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False
    )
    config = ServeConfig(
        model=args.model,
        workers=args.workers,
        kv_cache_memory=args.kv_cache_memory,
        num_cpus_per_worker=1.0,
        health_check_period_s=1.0,
    )
    handle = deploy(config)
    reference, ref_wall = asyncio.run(workload(handle, convs, args.max_tokens))
    serve.delete(APP_NAME)
    handle = deploy(config)  # fresh pools: the fault run starts where the reference did
    stop, kills = threading.Event(), []
    thread = threading.Thread(
        target=killer, args=(handle, args.kill_every, args.workers, stop, kills), daemon=True
    )
    thread.start()
    faulty, wall = asyncio.run(workload(handle, convs, args.max_tokens))
    stop.set()
    thread.join(timeout=REPLACE_LIMIT_S)
    serve.delete(APP_NAME)
    ray.shutdown()

    pairs = [
        (r, f)
        for rc, fc in zip(reference, faulty, strict=True)
        for r, f in zip(rc, fc, strict=True)
    ]
    failed = sum(not f["ok"] for _, f in pairs)
    wrong = sum(f["ok"] and r["ok"] and f["text"] != r["text"] for r, f in pairs)
    good = sum(f["ok"] and r["ok"] and f["text"] == r["text"] for r, f in pairs)
    ref_good = sum(r["ok"] for r, _ in pairs)
    replace = [k["replace_s"] for k in kills if k["replace_s"] is not None]
    print(
        json.dumps(
            {
                "bench": "failover",
                "model": args.model,
                "workers": args.workers,
                "requests": len(pairs),
                "kills": len(kills),
                "kill_every_s": args.kill_every,
                "failed": failed,
                "wrong": wrong,
                "migrations": sum(f["kvmesh"]["migrations"] for _, f in pairs if f["ok"]),
                "goodput_ratio": round((good / wall) / (ref_good / ref_wall), 3),
                "replace_s": round(statistics.median(replace), 2) if replace else None,
                "replace_s_max": max(replace) if replace else None,
                "wall_s": round(wall, 1),
                "reference_wall_s": round(ref_wall, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
