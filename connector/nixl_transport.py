"""Block transport over NIXL: one-sided `READ` from the peer's registered KV memory.

Each worker has one NIXL agent (named after its worker id) and registers `KVCache.data` once,
as DRAM on the CPU or VRAM on a GPU. Descriptors are per slab, prepared once:

    descriptor i = (layer, kv, block) with i = (layer * 2 + kv) * num_blocks + block,
    address = base + i * block_nbytes, length = block_nbytes

i.e. `KVCache.block_offset(layer, kv, block) / block_nbytes`, the same order as `data`'s
memory. The local list is prepared at init, a peer's list (from its base address and its own
num_blocks) at `add_peer`, so a pull is only index arithmetic plus `make_prepped_xfer`. The
indices go slab-major, blocks in request order within a slab, so that runs of consecutive
block ids on both sides sit next to each other in the request and NIXL merges them into one
descriptor (measured: a contiguous 128-block pull is about twice as fast as a scattered one).

nixl is imported inside `NixlTransport.__init__`: this module imports without it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvmesh.connector.transport import BlockTransport, PeerInfo, TransferError, TransferInFlight
from kvmesh.workers.kv_cache import KVCache

logger = logging.getLogger(__name__)

# Polling interval while a transfer is in flight: starts short against a ~1 ms block pull and
# doubles up to _MAX_POLL_S, so a long pull (on its own thread, beside the step thread) does
# not take the GIL 20000 times a second, nor starve NIXL's progress thread of a core.
_POLL_S = 50e-6
_MAX_POLL_S = 1e-3
# NIXL's UCX progress thread waits on the UCX workers' event fds with this timeout (µs,
# rounded up to ms). The Python wrapper hard-codes 0, which makes the thread spin: one core
# per idle worker (measured). 100 ms keeps it event-driven; it still wakes on every message.
_PROGRESS_THREAD_DELAY_US = 100_000


@contextmanager
def _progress_thread_delay(delay_us: int) -> Iterator[None]:
    """While active, NIXL agents are created with `pthrDelay = delay_us`.

    The holder needs its progress thread (a puller's first read waits on the holder's UCX
    worker to answer the connection setup; it hangs with the thread disabled), so the thread
    stays and only its idle wait changes. Patches the bindings' constructor for the duration
    (agents are created once per worker); a nixl without that hook gets the default.
    """
    from nixl import _api

    real = getattr(_api.nixlBind, "nixlAgent", None)
    if real is None:
        yield
        return

    def make(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real(name, config)

    _api.nixlBind.nixlAgent = make
    try:
        yield
    finally:
        _api.nixlBind.nixlAgent = real


# UCX's TCP transport (between hosts without RDMA) moves a READ as active messages of at most
# its segment size, 8 KiB by default: a slab of 12 KiB (16 tokens of one smollm2 layer's K or V)
# took two, and a 2,048-token pull some 16,000. With 64 KiB a slab fits in one: between two
# network namespaces over a 10 Gbit/s veth, 7.4 Gbit/s median against 4.8 (BENCHMARKS.md,
# fault suite). No effect on the other transports; values in the environment win.
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_RX_SEG_SIZE": "64k"}

_MADV_COLLAPSE = 25  # Linux >= 6.1
_HUGE_PAGE = 2 << 20


def _collapse_to_huge_pages(data: torch.Tensor) -> bool:
    """Best effort: back a CPU tensor's memory with 2 MiB transparent huge pages, now.

    UCX moves DRAM between processes of one node with CMA (process_vm_readv), which walks and
    pins both sides' pages; on huge pages a 94 MB pull ran about twice as fast here. Costs one
    in-kernel copy (~50 ms for 94 MB). False where unsupported (GPU tensor, not Linux, kernel
    < 6.1, THP off); the memory's content never changes.
    """
    if data.is_cuda or not sys.platform.startswith("linux"):
        return False
    begin, end = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
    start, stop = -(-begin // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if stop <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _MADV_COLLAPSE) == 0


def _slab_descs(base: int, num_slabs: int, slab_nbytes: int, device_id: int) -> np.ndarray:
    """Nx3 (address, length, device id) rows, one per slab, in memory order."""
    descs = np.empty((num_slabs, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_slabs, dtype=np.uint64) * np.uint64(slab_nbytes)
    descs[:, 1] = slab_nbytes
    descs[:, 2] = device_id
    return descs


def _slab_indices(block_ids: Sequence[int], num_layers: int, num_blocks: int) -> np.ndarray:
    """Descriptor indices of `block_ids`' slabs: slab-major, blocks in the given order."""
    slabs = np.arange(num_layers * 2, dtype=np.int64)[:, None] * num_blocks
    return (slabs + np.asarray(block_ids, dtype=np.int64)[None, :]).ravel().astype(np.int32)


class NixlTransport(BlockTransport):
    """NIXL (UCX backend) transport. Raises at init when nixl or its UCX plugin is missing.

    `huge_pages`: move a CPU cache onto transparent huge pages before registering it (see
    `_collapse_to_huge_pages`); it only changes speed.
    """

    name = "nixl"

    def __init__(
        self, worker_id: str, kv_cache: KVCache, fingerprint_id: str, *, huge_pages: bool = True
    ) -> None:
        super().__init__(worker_id, kv_cache, fingerprint_id)
        from nixl._api import nixl_agent, nixl_agent_config

        data = kv_cache.data
        # Before registration: a backend that pins memory at registration would keep 4K pages.
        self.huge_pages = huge_pages and _collapse_to_huge_pages(data)
        self._mem_type = "VRAM" if data.is_cuda else "DRAM"
        self._device_id = (data.device.index or 0) if data.is_cuda else 0
        self._num_slabs = kv_cache.num_layers * 2 * kv_cache.num_blocks
        for name, value in UCX_DEFAULTS.items():  # UCX reads them when the agent starts
            os.environ.setdefault(name, value)
        with _progress_thread_delay(_PROGRESS_THREAD_DELAY_US):
            self._agent = nixl_agent(worker_id, nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend plugin")
        self._reg = self._agent.register_memory(data)
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _slab_descs(data.data_ptr(), self._num_slabs, kv_cache.block_nbytes, self._device_id),
            self._mem_type,
        )
        self._remote: dict[str, Any] = {}  # peer id -> prepped descriptor list handle
        self._closed = False

    def _local_meta(self) -> dict[str, Any]:
        return {
            "agent": self._agent.get_agent_metadata(),
            "base": self.kv_cache.data.data_ptr(),
            "mem_type": self._mem_type,
            "device_id": self._device_id,
        }

    def _connect(self, peer: PeerInfo, handle: Any) -> None:
        agent_name = self._agent.add_remote_agent(peer.meta["agent"])
        if isinstance(agent_name, bytes):
            agent_name = agent_name.decode()
        if agent_name != peer.worker_id:
            self._agent.remove_remote_agent(agent_name)
            raise TransferError(f"peer {peer.worker_id}'s NIXL agent is named {agent_name!r}")
        num_slabs = peer.layout.shape[0] * 2 * peer.layout.num_blocks
        descs = _slab_descs(
            peer.meta["base"], num_slabs, peer.layout.block_nbytes, peer.meta["device_id"]
        )
        self._remote[peer.worker_id] = self._agent.prep_xfer_dlist(
            peer.worker_id, descs, peer.meta["mem_type"]
        )

    def _disconnect(self, peer_id: str) -> None:
        self._agent.release_dlist_handle(self._remote.pop(peer_id))
        self._agent.remove_remote_agent(peer_id)

    def read_blocks(
        self,
        peer_id: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float,
        lease_id: str | None = None,
    ) -> int:
        deadline = time.monotonic() + timeout_s
        peer = self._peer(peer_id)
        self._check_ids(peer, remote_block_ids, local_block_ids)
        if not local_block_ids:
            return 0
        num_layers = self.kv_cache.num_layers
        remote_idx = _slab_indices(remote_block_ids, num_layers, peer.layout.num_blocks)
        local_idx = _slab_indices(local_block_ids, num_layers, self.kv_cache.num_blocks)
        try:
            xfer = self._agent.make_prepped_xfer(
                "READ", self._local, local_idx, self._remote[peer_id], remote_idx
            )
        except Exception as e:  # nixl raises its own exception types from the bindings
            raise TransferError(f"cannot set up a read from {peer_id}: {e}") from e
        poll = _POLL_S
        try:
            state = self._agent.transfer(xfer)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(poll)
                poll = min(poll * 2, _MAX_POLL_S)
                state = self._agent.check_xfer_state(xfer)
        except Exception as e:
            state = f"ERR ({e})"
        what = f"read of {len(local_block_ids)} blocks from {peer_id}"
        if state == "PROC":
            # UCX cannot cancel an RMA GET: releasing the handle would leave the read running
            # (writing into blocks the caller is about to reuse), with no way to see it end.
            # Keep the handle; the caller quarantines the blocks until ``is_over``.
            msg = f"{what} timed out after {timeout_s}s"
            raise TransferInFlight(msg, functools.partial(self._over, xfer))
        released = self._release(xfer)
        if state != "DONE":
            msg = f"{what} failed: {state}"
            if not released:  # NIXL would not let go of it: it may still be running
                raise TransferInFlight(msg, functools.partial(self._over, xfer))
            raise TransferError(msg)
        return len(local_block_ids) * self.kv_cache.block_bytes_all_layers

    def _release(self, xfer: Any, warn: bool = True) -> bool:
        """Release a transfer's handle; False when NIXL refuses (an active transfer it could
        not cancel): the handle stays, and so may writes into its local blocks."""
        try:
            self._agent.release_xfer_handle(xfer)
            return True
        except Exception as e:
            if warn:
                logger.warning("%s: could not release a NIXL transfer: %s", self.worker_id, e)
            return False

    def _over(self, xfer: Any) -> bool:
        """For a transfer that could not be cancelled: is it over (and released) now?"""
        try:
            if self._agent.check_xfer_state(xfer) == "PROC":
                return False
        except Exception as e:  # an error state ends the transfer too; release decides
            logger.debug("%s: transfer state check failed: %s", self.worker_id, e)
        return self._release(xfer, warn=False)  # polled: the first refusal was logged

    def close(self) -> None:
        """Remove peers, release the local descriptor list and deregister the KV memory."""
        if self._closed:
            return
        super().close()
        self._agent.release_dlist_handle(self._local)
        self._agent.deregister_memory(self._reg)
        self._closed = True
