"""What the scenarios of bench/chaos_driver.py share: the prompts (a system prompt every
request shares, so its blocks get pulled), their no-fault reference, the common columns of a
row, the mixed load, the serving app's stats and index actor."""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from ray import serve

from kvmesh.cluster.serve_app import APP_NAME
from kvmesh.connector.index_actor import ACTOR_NAME_PREFIX
from tests.two_hosts_client import prompt, traffic
from tests.two_hosts_client import reference as no_fault_outputs

SHARED = prompt(120, salt=7)  # a system prompt every chat shares: its blocks get pulled
WORKERS = 2  # every app the scenarios run on serves two workers


def stats() -> dict[str, Any]:
    return serve.get_app_handle(APP_NAME).stats.remote().result(timeout_s=30)


def texts(n: int, salt: int) -> list[str]:
    return [f"{SHARED} {prompt(12, salt=salt * 1000 + i)}" for i in range(n)]


def reference(n: int, max_tokens: int, salt: int) -> dict[str, Any]:
    """The no-fault outputs of ``traffic``'s requests for ``texts(n, salt)``."""
    return no_fault_outputs(texts(n, salt), max_tokens)


def summary(name: str, ref: dict, run: dict, **figures: Any) -> dict[str, Any]:
    """The common columns: requests, failed, wrong (an output unlike the no-fault
    reference's)."""
    results = run["results"]
    good = [r for r in results if r["ok"]]
    wrong = sum(
        1 for r, want in zip(results, ref["results"], strict=True) if r["ok"]
        and r["text"] != want["text"]
    )  # fmt: skip
    return {
        "scenario": name,
        "requests": len(results),
        "failed": len(results) - len(good),
        "wrong": wrong,
        "migrations": sum(r["kvmesh"]["migrations"] for r in good),
        "seconds": run["seconds"],
        **figures,
    }


def run_traffic(base_url: str, n: int, max_tokens: int, salt: int, fault: Any = None) -> dict:
    """``n`` mixed requests; ``fault`` (if any) runs in a thread once they are under way, on
    a whole cluster: a replica that replaces one an earlier fault lost may still be starting,
    and then every request runs on the other worker and a fault there moves all of them
    (replica_hung after worker_hung: 64 migrations, slowest 28.8 s, against ~22 and ~14 s)."""
    if fault is not None:
        whole_cluster()
        threading.Timer(1.0, fault).start()
    return traffic(base_url, texts(n, salt), max_tokens, concurrency=n)


def index_actor(timeout_s: float = 60.0) -> Any:
    """The serving app's index actor: the one with workers registered (an earlier app's, of
    another model, may linger empty under its own name), waiting while a killed one is
    being replaced and its workers rejoin."""
    deadline = time.monotonic() + timeout_s
    while True:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].startswith(ACTOR_NAME_PREFIX):
                handle = ray.get_actor(a["name"], namespace=a["namespace"])
                try:
                    if ray.get(handle.workers.remote(), timeout=10):
                        return handle
                except (ray.exceptions.RayError, TimeoutError):
                    pass  # being replaced
        if time.monotonic() > deadline:
            raise RuntimeError(f"no index actor with workers after {timeout_s} s")
        time.sleep(0.2)


def whole_cluster(timeout_s: float = 120.0) -> None:
    """Wait until the app lists all its ``WORKERS``."""
    wait_until(lambda: len(stats().get("workers", {})) >= WORKERS, timeout_s)


def wait_until(cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.1)
