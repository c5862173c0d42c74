"""What the ingress reports of the cluster (``/metrics``, the handle's ``stats``): per-worker
queues and pool, the index's size, pull counters and tier totals, read from the workers the
index knows (a worker gone is gone from here too)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvmesh.cluster.metrics import tier_totals
from kvmesh.connector.index_actor import get_index_actor

logger = logging.getLogger(__name__)
STATS_TIMEOUT_S = 2.0  # per call: a worker or index that does not answer is left out


class ClusterStats:
    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.index = get_index_actor(fingerprint)

    async def read(self) -> dict[str, Any]:
        """The stats; empty while the index is down."""
        for attempt in range(2):
            try:
                workers = await _within(self.index.workers.remote())
                index = await _within(self.index.stats.remote())
                break
            except Exception as e:
                logger.warning("index unavailable for stats: %s", type(e).__name__)
                if attempt:
                    return {}
                # A killed index is recreated by name (the workers rejoin it): look it up.
                self.index = get_index_actor(self.fingerprint)
        handles = {w: m["handle"] for w, m in workers.items() if m.get("handle") is not None}
        occupancy = await asyncio.gather(
            *(_within(h.occupancy.remote()) for h in handles.values()), return_exceptions=True
        )
        conns = await asyncio.gather(
            *(_within(h.connector_stats.remote()) for h in handles.values()),
            return_exceptions=True,
        )
        good = [c for c in conns if isinstance(c, dict)]
        return {
            "workers": {
                w: o for w, o in zip(handles, occupancy, strict=True) if isinstance(o, dict)
            },
            "index_blocks": index.get("blocks", 0),
            "pull_bytes": sum(c.get("pulled_bytes", 0) for c in good),
            "pull_failures": sum(c.get("pull_failures", 0) for c in good),
            "pull_s": sum(c.get("pull_s", 0.0) for c in good),
            "pulls": sum(c.get("pulls", 0) for c in good),
            "snapshots_sent": sum(c.get("snapshots_sent", 0) for c in good),
            "index": index,
            **tier_totals(good),
        }


async def _within(ref: Any) -> Any:
    return await asyncio.wait_for(ref, STATS_TIMEOUT_S)
