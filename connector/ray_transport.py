"""Block transport through the Ray object store: the fallback when NIXL is absent.

The puller calls `export_blocks(lease_id, block_ids)` on the holder's worker actor, which
checks that the blocks are under that live lease (the puller's, from `pin`) and gathers them into
one uint8 array (one copy) that Ray puts in the object store; on the puller's node `ray.get`
maps it without a copy, and one indexed assignment scatters it into the local blocks. Slower
than NIXL (the holder does the gather, Ray adds a put), but it needs nothing beyond Ray.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch

from kvmesh.connector.transport import BlockTransport, PeerInfo, TransferError
from kvmesh.workers.kv_cache import KVCache


class RayTransport(BlockTransport):
    """Pulls via `handle.export_blocks.remote(lease_id, ids)` on the peer's worker actor.

    `add_peer` needs that actor handle; it raises ValueError without one.
    """

    name = "ray"

    def __init__(self, worker_id: str, kv_cache: KVCache, fingerprint_id: str) -> None:
        super().__init__(worker_id, kv_cache, fingerprint_id)
        self._handles: dict[str, Any] = {}

    def _connect(self, peer: PeerInfo, handle: Any) -> None:
        if handle is None:
            raise ValueError(f"the Ray transport needs peer {peer.worker_id}'s actor handle")
        self._handles[peer.worker_id] = handle

    def _disconnect(self, peer_id: str) -> None:
        self._handles.pop(peer_id, None)

    def read_blocks(
        self,
        peer_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float,
        lease_id: str | None = None,
    ) -> int:
        peer = self._peer(peer_id)
        self._check_ids(peer, remote_block_ids, local_block_ids)
        if not local_block_ids:
            return 0
        ref = self._handles[peer_id].export_blocks.remote(lease_id, list(remote_block_ids))
        try:
            raw = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TransferError(f"read from {peer_id} timed out after {timeout_s}s") from e
        except ray.exceptions.RayError as e:  # actor died, task raised, object lost
            raise TransferError(f"read from {peer_id} failed: {type(e).__name__}: {e}") from e
        n, cache = len(local_block_ids), self.kv_cache
        expected = n * cache.block_bytes_all_layers
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.nbytes != expected:
            got = getattr(raw, "nbytes", type(raw).__name__)
            raise TransferError(f"{peer_id} sent {got} bytes for {n} blocks, expected {expected}")
        with warnings.catch_warnings():
            # The object store's buffer is read-only; we only read from it.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            src = torch.from_numpy(raw)
        blocks = src.view(cache.dtype).view(
            n, cache.num_layers, 2, cache.block_size, cache.num_kv_heads, cache.head_dim
        )
        index = torch.tensor(list(local_block_ids), dtype=torch.long, device=cache.device)
        # One scatter into [L, 2, num_blocks, ...] along the block axis.
        cache.data.index_copy_(2, index, blocks.to(cache.device).movedim(0, 2))
        return expected
