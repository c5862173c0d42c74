"""Start worker actors the way the cluster layer does, for tests."""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

import ray

from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.worker_actor import worker_actor_class

_names = itertools.count()


def start_workers(
    n: int,
    *,
    model: str = "tiny-random",
    transport: str | None = "nixl",
    connector: bool = True,
    block_size: int = 4,
    num_kv_blocks: int | None = 64,
    timeout_s: float = 10.0,
    **engine_kw: Any,
) -> list[Any]:
    """``n`` worker actors sharing one index (same model and cache layout), all ready;
    ``timeout_s``: their connectors' (index calls, pins, transfers)."""
    cfg = EngineConfig(
        model=model,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        progress=False,
        **engine_kw,
    )
    conn = ClusterConnectorConfig(transport=transport, timeout_s=timeout_s) if connector else None
    cls = worker_actor_class(num_gpus=0, num_cpus=0)
    handles = [
        cls.remote(f"w{next(_names)}-{transport}", cfg, conn, num_threads=1) for _ in range(n)
    ]
    ray.get([h.ready.remote() for h in handles])
    return handles


def stop_workers(handles: list[Any]) -> None:
    """Deregister cleanly, then kill (so later tests see no stale holders)."""
    for h in handles:
        with contextlib.suppress(Exception):  # already dead is fine
            ray.get(h.shutdown.remote(), timeout=10)
        ray.kill(h)


def flush(handles: list[Any]) -> None:
    ray.get([h.flush_events.remote() for h in handles])


def wait_until(predicate: Any, timeout_s: float = 15.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
