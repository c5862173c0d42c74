"""Transfer faults on purpose: a test and bench hook, never a production setting.

`FaultyTransport` wraps any `BlockTransport` and makes some of its reads go wrong, drawn per
read from a seeded RNG (the same seed and worker id give the same sequence of faults):

- ``fail``: the read raises `TransferError` at once; no byte moves.
- ``timeout``: the read waits past its ``timeout_s``, then raises; no byte moves (what a
  transport that can cancel does: the Ray one drops the late object).
- ``partial``: the first half of the blocks is really read, the next block gets garbage in its
  first half of the layers (a torn block), the rest keep their stale bytes; then it raises.
- ``late``: like ``timeout``, but the read is still running when it raises
  (`TransferInFlight`): garbage lands in the destination blocks ``late_after_s`` later, from
  another thread, and only then does the error's ``is_over()`` turn True. This is what NIXL
  over UCX does: an RMA GET cannot be cancelled (``ucp_request_cancel`` only cancels tag
  receives), so a timed-out read goes on writing (measured with UCX_TLS=tcp between two
  processes: 22 of 63 blocks written when the timeout raised, all 63 half a second later).
  Garbage stands for the worst case, the holder's block reused once the lease was released.

Switched on only by an explicit `TransferFaults`: `ClusterConnectorConfig.faults`, or the
`KVMESH_FAULT_TRANSPORT` environment variable (`TransferFaults.from_env`, read in one place,
`make_transport`), whose value must spell the fields out, e.g.
``fail_rate=0.04,timeout_rate=0.03,partial_rate=0.03,seed=1``. Anything else there (``1``,
``true``, an unknown key) is refused with a ValueError, so the worker does not start; every
wrapped transport logs a warning and counts what it injected (`get_stats`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvmesh.connector.transfer_faults import KINDS, TransferFaults
from kvmesh.connector.transport import BlockTransport, PeerInfo, TransferError, TransferInFlight

logger = logging.getLogger(__name__)

_TIMEOUT_SLACK_S = 0.01  # an injected timeout returns this long after the deadline
_GARBAGE_SCALE = 4.0  # garbage is N(0, 4^2): plausible floats, far from any real KV


class FaultyTransport(BlockTransport):
    """`inner` with faults injected into `read_blocks`; everything else is `inner`'s.

    Peers see `inner`'s `local_info` (its transport name), so a faulty worker and a plain one
    connect as usual.
    """

    name = "faulty"

    def __init__(self, inner: BlockTransport, faults: TransferFaults) -> None:
        if not isinstance(faults, TransferFaults):
            raise TypeError(f"faults must be a TransferFaults, got {type(faults).__name__}")
        super().__init__(inner.worker_id, inner.kv_cache, inner.fingerprint_id)
        self.inner = inner
        self.faults = faults
        # A string seed is hashed deterministically (not by PYTHONHASHSEED): reproducible.
        self._rng = random.Random(f"{faults.seed}:{inner.worker_id}")
        self._counts = dict.fromkeys(("reads", *KINDS), 0)
        self._lock = threading.Lock()  # late writes run on timer threads
        self._late: set[threading.Timer] = set()
        logger.warning(
            "%s: FAULT INJECTION ON (%s): a test/bench hook, never for serving",
            inner.worker_id,
            faults,
        )

    # -- delegated ---------------------------------------------------------------------------

    def local_info(self) -> bytes:
        return self.inner.local_info()

    def add_peer(self, info: bytes, handle: Any = None) -> str:
        return self.inner.add_peer(info, handle)

    def remove_peer(self, peer_id: str) -> None:
        self.inner.remove_peer(peer_id)

    def export_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        return self.inner.export_blocks(block_ids)

    def close(self) -> None:
        with self._lock:
            timers, self._late = self._late, set()
        for timer in timers:
            timer.cancel()
        self.inner.close()

    def _connect(self, peer: PeerInfo, handle: Any) -> None:
        raise AssertionError("unreachable: add_peer is the inner transport's")

    def _disconnect(self, peer_id: str) -> None:
        raise AssertionError("unreachable: remove_peer is the inner transport's")

    # -- faults ------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, float]:
        """Reads seen, faults injected by kind, late writes not landed yet."""
        with self._lock:
            stats: dict[str, float] = {"fault_reads": self._counts["reads"]}
            stats.update({f"injected_{kind}": self._counts[kind] for kind in KINDS})
            stats["late_writes_pending"] = len(self._late)
        return stats

    def read_blocks(
        self,
        peer_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float,
        lease_id: str | None = None,
    ) -> int:
        kind = self._draw() if local_block_ids else None
        if kind is None:
            return self.inner.read_blocks(
                peer_id, remote_block_ids, local_block_ids, timeout_s, lease_id
            )
        local = list(local_block_ids)
        what = f"read of {len(local)} blocks from {peer_id}"
        if kind == "fail":
            raise TransferError(f"{what} failed (injected)")
        if kind == "partial":
            half = len(local) // 2
            if half:  # a real read of the first half: bytes that are right, yet unfinished
                self.inner.read_blocks(
                    peer_id, remote_block_ids[:half], local[:half], timeout_s, lease_id
                )
            self._write_garbage([local[half]], torn=True)
            raise TransferError(f"{what} broke off after {half} blocks (injected)")
        time.sleep(timeout_s + _TIMEOUT_SLACK_S)
        msg = f"{what} timed out after {timeout_s}s (injected)"
        if kind == "late":
            raise TransferInFlight(msg, self._schedule_late_write(local).is_set)
        raise TransferError(msg)

    def _draw(self) -> str | None:
        with self._lock:
            self._counts["reads"] += 1
            x = self._rng.random()
            for kind, rate in self.faults.rates.items():
                if x < rate:
                    self._counts[kind] += 1
                    return kind
                x -= rate
        return None

    def _write_garbage(self, block_ids: list[int], torn: bool = False) -> None:
        """Seeded noise into whole blocks, or (``torn``) into their first half of layers."""
        data = self.kv_cache.data
        layers = max(1, data.shape[0] // 2) if torn else data.shape[0]
        with self._lock:
            seed = self._rng.getrandbits(63)
        shape = (layers, data.shape[1], len(block_ids), *data.shape[3:])
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        index = torch.tensor(block_ids, dtype=torch.long, device=data.device)
        data[:layers].index_copy_(2, index, (noise * _GARBAGE_SCALE).to(data.device, data.dtype))

    def _schedule_late_write(self, block_ids: list[int]) -> threading.Event:
        """Garbage into ``block_ids`` in ``late_after_s``; the event is set once it landed."""
        over = threading.Event()

        def land() -> None:
            with self._lock:
                if timer not in self._late:  # closed meanwhile
                    return
            try:
                self._write_garbage(block_ids)
            finally:
                with self._lock:
                    self._late.discard(timer)
                over.set()

        timer = threading.Timer(self.faults.late_after_s, land)
        timer.daemon = True
        with self._lock:
            self._late.add(timer)
        timer.start()
        return over
