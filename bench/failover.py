"""Failover under load: bench/cluster.py's multi-turn chat on 3 workers, one worker replica
killed every ``--kill-every`` seconds, against a no-fault run of the same workload.

Reports failed requests, outputs that differ from the no-fault run (greedy, so they must not),
goodput (correct requests per second) against the no-fault run, how many requests moved
(migrations), and seconds from each kill until Serve runs the full worker count again and the
replacement has registered with the index. One JSON line.

With ``--prefill-workers P --decode-workers D`` (prefill/decode) the prefill replicas are the
ones killed, and the fault run is made twice beside the one reference: with the ingress's
``prefill_wait_s`` bound (the decode worker computes a prompt no prefill replica takes in
time) and without it (prompts queue for the replacement, as before the bound); each run's
request latencies (p50 / p99 / max) and how many prompts decode computed are reported.

    .venv/bin/python bench/failover.py [--model smollm2-135m] [--kill-every 20]
    .venv/bin/python bench/failover.py --prefill-workers 1 --decode-workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve
from stats import percentile

from cluster import conversation_turns
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_app import APP_NAME, deploy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests/
from tests.serve_helpers import replica_actor, running_replicas

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
        start = time.perf_counter()
        try:
            res = await handle.generate.remote({**body, "ignore_eos": True})
            latency = time.perf_counter() - start
            out.append({"ok": True, "text": res["text"], "kvmesh": res["kvmesh"], "s": latency})
            messages.append({"role": "assistant", "content": res["text"]})
        except Exception as e:
            out.append({"ok": False, "error": type(e).__name__})
            messages.append({"role": "assistant", "content": ""})
    return out


async def workload(handle: Any, convs: list[list[str]], max_tokens: int) -> tuple[list, float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(conversation(handle, c, max_tokens) for c in convs))
    return results, time.perf_counter() - start


def killer(
    handle: Any, every_s: float, role: str, workers: int, stop: threading.Event, log: list
) -> None:
    """Kill one busy replica of ``role`` every ``every_s``; record seconds until it is
    replaced (``workers``: the app's worker count, all roles)."""
    while not stop.wait(every_s):
        loads = handle.stats.remote().result()["workers"]
        loads = {w: load for w, load in loads.items() if w.startswith(f"{role}-")}
        if not loads:
            continue
        victim = max(loads, key=lambda w: (loads[w]["running"] + loads[w]["waiting"], w))
        count = running_replicas(role)  # the role's replicas before the kill
        try:
            ray.kill(replica_actor(victim))
        except ValueError:
            continue
        killed = time.monotonic()
        entry: dict[str, Any] = {"victim": victim, "replace_s": None}
        log.append(entry)
        # Until replaced, even after the workload ended (bounded): replace_s is the figure.
        while time.monotonic() - killed < REPLACE_LIMIT_S:
            live = handle.stats.remote().result()["workers"]
            if victim not in live and len(live) == workers and running_replicas(role) == count:
                entry["replace_s"] = round(time.monotonic() - killed, 2)
                break
            time.sleep(0.25)


def fault_run(
    config: ServeConfig, convs: list, reference: list, ref_wall: float, args: Any, role: str
) -> dict[str, Any]:
    """The workload on fresh replicas while ``role``'s replicas are killed; its figures."""
    handle = deploy(config)  # fresh pools: the fault run starts where the reference did
    stop, kills = threading.Event(), []
    workers = (config.workers or 0) + config.prefill_workers + config.decode_workers
    thread = threading.Thread(
        target=killer, args=(handle, args.kill_every, role, workers, stop, kills), daemon=True
    )
    thread.start()
    faulty, wall = asyncio.run(workload(handle, convs, args.max_tokens))
    stop.set()
    thread.join(timeout=REPLACE_LIMIT_S)
    serve.delete(APP_NAME)
    pairs = [
        (r, f)
        for rc, fc in zip(reference, faulty, strict=True)
        for r, f in zip(rc, fc, strict=True)
    ]
    good = sum(f["ok"] and r["ok"] and f["text"] == r["text"] for r, f in pairs)
    ref_good = sum(r["ok"] for r, _ in pairs)
    replace = [k["replace_s"] for k in kills if k["replace_s"] is not None]
    latency = sorted(f["s"] for _, f in pairs if f["ok"])
    row = {
        "requests": len(pairs),
        "kills": len(kills),
        "failed": sum(not f["ok"] for _, f in pairs),
        "wrong": sum(f["ok"] and r["ok"] and f["text"] != r["text"] for r, f in pairs),
        "migrations": sum(f["kvmesh"]["migrations"] for _, f in pairs if f["ok"]),
        "goodput_ratio": round((good / wall) / (ref_good / ref_wall), 3),
        "replace_s": round(statistics.median(replace), 2) if replace else None,
        "replace_s_max": max(replace) if replace else None,
        "latency_s_p50": round(statistics.median(latency), 2) if latency else None,
        "latency_s_p99": round(percentile(latency, 0.99), 2) if latency else None,
        "latency_s_max": round(latency[-1], 2) if latency else None,
        "wall_s": round(wall, 1),
    }
    if config.disaggregated:
        row["decode_computed_prompts"] = sum(
            "prefill_worker" not in f["kvmesh"] for _, f in pairs if f["ok"]
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--prefill-workers", type=int, default=0, help="P/D: kill these instead")
    ap.add_argument("--decode-workers", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="160MiB")
    ap.add_argument("--kill-every", type=float, default=20.0)
    args = ap.parse_args()

    convs = [conversation_turns(i, args.turns) for i in range(args.conversations)]
    pd = bool(args.prefill_workers)
    roles = {"prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers}
    workers = sum(roles.values()) if pd else args.workers
    ray.init(address="local", num_cpus=workers + 1, include_dashboard=False, log_to_driver=False)
    config = ServeConfig(
        model=args.model,
        **(roles if pd else {"workers": args.workers}),
        kv_cache_memory=args.kv_cache_memory,
        num_cpus_per_worker=1.0,
        health_check_period_s=1.0,
    )
    handle = deploy(config)
    reference, ref_wall = asyncio.run(workload(handle, convs, args.max_tokens))
    serve.delete(APP_NAME)
    row: dict[str, Any] = {
        "bench": "failover",
        "model": args.model,
        "workers": workers,
        "kill_every_s": args.kill_every,
        "reference_wall_s": round(ref_wall, 1),
    }
    if not pd:
        row |= fault_run(config, convs, reference, ref_wall, args, "worker")
    else:
        row |= roles
        # Beside the bound, the behaviour before it: a prompt waits for a prefill replica.
        unbounded = dataclasses.replace(config, prefill_wait_s=1e6)
        row["runs"] = {
            f"prefill_wait_{config.prefill_wait_s:g}s": fault_run(
                config, convs, reference, ref_wall, args, "prefill"
            ),
            "prefill_wait_unbounded": fault_run(
                unbounded, convs, reference, ref_wall, args, "prefill"
            ),
        }
    ray.shutdown()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
