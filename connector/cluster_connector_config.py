"""``ClusterConnectorConfig``: the cluster connector's settings, checked when made, and the
factory a worker calls to build its ``ClusterKvConnector`` (picklable: the cluster layer
ships it to each worker actor)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.connector.transfer_faults import TransferFaults
from kvmesh.workers.peer_leases import MAX_LEASE_S

if TYPE_CHECKING:
    from kvmesh.connector.cluster_connector import ClusterKvConnector
    from kvmesh.workers.engine import ConnectorContext


@dataclass(frozen=True)
class ClusterConnectorConfig:
    """Built by the cluster layer and shipped to each worker actor (it is picklable)."""

    transport: str | None = None  # "nixl", "ray", or None: NIXL when importable
    # How long a holder keeps blocks pinned for one pull: at least timeout_s (the read it
    # protects may take that long), at most the holders' MAX_LEASE_S (they refuse longer).
    lease_s: float = 10.0
    timeout_s: float = 5.0  # index round trips, pins and transfers
    publish_interval_s: float = 0.02
    heartbeat_interval_s: float = 1.0
    min_pull_blocks: int = 1  # pull only when a peer has at least this many more blocks
    faults: TransferFaults | None = None  # test/bench hook only: inject transfer faults

    def __post_init__(self) -> None:
        for name in ("lease_s", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name}: must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be finite and > 0, got {value!r}")
        if self.lease_s > MAX_LEASE_S:
            raise ValueError(
                f"lease_s: {self.lease_s} is over the {MAX_LEASE_S} s holders grant; "
                "every pin would be refused"
            )
        if self.lease_s < self.timeout_s:
            raise ValueError(
                f"lease_s ({self.lease_s}) is shorter than timeout_s ({self.timeout_s}): a lease "
                "could expire during the read it protects"
            )

    def __call__(self, ctx: ConnectorContext) -> ClusterKvConnector:
        from kvmesh.connector.cluster_connector import ClusterKvConnector

        return ClusterKvConnector(ctx, self)
