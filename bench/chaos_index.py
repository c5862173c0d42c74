"""The index scenarios of bench/chaos.py (run by bench/chaos_driver.py inside host a): the
index actor killed under load (seconds until every worker rejoined), and its process stopped
(SIGSTOP) under a closed loop of short requests (the slowest request before, during and after,
and whether it purged a worker for the silence it could not hear)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import ray

from bench.chaos_common import (
    index_actor,
    reference,
    run_traffic,
    stats,
    summary,
    texts,
    wait_until,
)
from kvmesh.connector.index_actor import ACTOR_NAME_PREFIX
from tests.two_hosts_client import complete, streamed


def index_killed(base_url: str, n: int, max_tokens: int) -> dict[str, Any]:
    ref = reference(n, max_tokens, salt=2)
    done: dict[str, Any] = {}

    def fault() -> None:
        names = [
            a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(ACTOR_NAME_PREFIX)
        ]  # fmt: skip
        for a in names:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=False)
        at = time.monotonic()
        want = len(stats().get("workers", {})) or 2
        while len(stats().get("workers", {})) < want:
            time.sleep(0.1)
        done["rejoined_s"] = round(time.monotonic() - at, 2)

    run = run_traffic(base_url, n, max_tokens, salt=2, fault=fault)
    wait_until(lambda: "rejoined_s" in done, 60)
    return summary("index_killed", ref, run, workers_rejoined_s=done.get("rejoined_s"))


def index_hung(base_url: str, hang_s: float, max_tokens: int, clients: int = 4) -> dict[str, Any]:
    """The index actor's process stopped (SIGSTOP: alive and silent, where a kill fails
    calls at once) for ``hang_s`` under a steady closed loop of short requests, then let go.
    Only the requests that asked it before a first call timed out may wait (the router's
    2 s, a worker lookup's ``timeout_s``); the rest route by load and compute. Figures: each
    phase's requests and slowest, and the index's stale purges meanwhile (its own pause is
    not its workers' silence)."""
    n = 600  # more than the loop sends in hang_s + 10 s here
    ref = reference(n, max_tokens, salt=5)
    prompts = texts(n, salt=5)
    index = index_actor()
    pid = ray.get(index.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    purged_before = ray.get(index.stats.remote(), timeout=30)["purged_stale"]
    workers_before = set(ray.get(index.workers.remote(), timeout=30))
    timed: list[tuple[float, float, dict[str, Any]]] = []  # (start, seconds, result)
    lock = threading.Lock()
    sent = iter(range(n))
    start = time.monotonic()
    hang = (start + 3.0, start + 3.0 + hang_s)
    end = hang[1] + 7.0

    def client() -> None:
        while time.monotonic() < end:
            with lock:
                i = next(sent, None)
            if i is None:
                return
            t = time.monotonic()
            out = complete(base_url, prompts[i], max_tokens, streamed(i))
            with lock:
                timed.append((t, time.monotonic() - t, {**out, "i": i}))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, hang[0] - time.monotonic()))
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(max(0.0, hang[1] - time.monotonic()))
    finally:
        os.kill(pid, signal.SIGCONT)
    for t in threads:
        t.join()
    timed.sort(key=lambda x: x[2]["i"])
    results = [r for _, _, r in timed]
    run = {"results": results, "seconds": round(time.monotonic() - start, 3)}
    ref = {"results": [ref["results"][r["i"]] for r in results]}

    def phase(lo: float, hi: float) -> dict[str, Any]:
        took = [secs for t, secs, _ in timed if lo <= t < hi]
        return {"requests": len(took), "max_s": round(max(took, default=0.0), 2)}

    stats_after = ray.get(index.stats.remote(), timeout=30)
    return summary(
        "index_hung", ref, run, hang_s=hang_s,
        before=phase(start, hang[0]), during=phase(*hang), after=phase(hang[1], end),
        purged_during_hang=stats_after["purged_stale"] - purged_before,
        workers_kept=workers_before <= set(ray.get(index.workers.remote(), timeout=30)),
    )  # fmt: skip
