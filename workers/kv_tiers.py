"""Tiers below the device pool: host memory, then local disk, for the blocks the pool evicts.

A block the pool is about to reuse is first copied out (``demote``) into the host tier, a
bounded LRU of blocks in one slab of host memory allocated at start (``memory_room``
allocates it with the pool, so its pages are taken when the worker starts, as vLLM's and
LMCache's CPU buffers are; pinned on a GPU worker). The host tier's least recently used
blocks move down to the disk tier: a bounded LRU of files in
``<disk_dir>/<fingerprint id>/slot-<k>/``, written by a thread of its own (a step never waits
on a disk). Until its file is written a block stays readable from memory and counts as a
host block. Reads (``read``) come from either tier; a tier hit is
promoted into fresh pool blocks by the connector (``workers/tiered_connector.py``) and keeps
its tier copy, so evicting it again costs no copy.

The disk tier's block files: workers/disk_tier.py.

``listener(medium, stored, removed)`` hears every change of what a tier holds (from the step
thread for the host tier, from the writer thread for the disk), so the index can know it.
Thread-safe: one lock guards the maps; file I/O runs outside it.
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.disk_tier import DiskTier
from kvmesh.workers.host_slots import HostSlots
from kvmesh.workers.tier_config import TierConfig, host_slots

logger = logging.getLogger(__name__)
_GONE = (
    "disk tier: block files are gone from %s (deleted outside kvmesh?); their tokens are "
    "computed (disk_missing_blocks counts them)"
)

# What a stopping worker spends writing its memory's blocks to disk at most (``keep_at_stop``):
# within the 10 s its replica gives it to shut down, after its step thread's end.
STOP_WRITE_BUDGET_S = 4.0

TierListener = Callable[[str, list[BlockHash], list[BlockHash]], None]
# Copies a pool block (by id) into a host uint8 tensor of the block's bytes (KVCache's
# read_block_into): the host tier's slot itself, so a demotion is one copy.
BlockCopier = Callable[[int, torch.Tensor], None]


class KvTiers:
    """The host tier (in memory) and the disk tier below it, with the disk's writer thread."""

    def __init__(
        self,
        config: TierConfig,
        fingerprint_id: str,
        block_nbytes: int,
        listener: TierListener | None = None,
        host_memory: torch.Tensor | None = None,
    ) -> None:
        """``host_memory``: the host tier's slab (a uint8 CPU tensor of
        ``host_slots(config.host_bytes, block_nbytes)`` blocks); None: one of its own."""
        self.config = config
        self.block_nbytes = block_nbytes
        self.listener = listener
        self._lock = threading.Lock()
        capacity = host_slots(config.host_bytes, block_nbytes)
        self.host = HostSlots(capacity, block_nbytes, host_memory)
        # Blocks on their way to disk: still readable, and still host blocks to the index.
        self.writing: dict[BlockHash, np.ndarray] = {}
        self.stats = dict.fromkeys(
            (
                "demoted_blocks",
                "host_evicted_blocks",
                "disk_written_blocks",
                "disk_evicted_blocks",
                "disk_write_errors",
                "disk_writes_dropped",
                "disk_corrupt_blocks",
                "disk_missing_blocks",
                "disk_scanned_blocks",
                "disk_scan_dropped",
                "disk_kept_at_stop",
            ),
            0,
        )
        self.disk: DiskTier | None = None
        self._queue: queue.Queue[BlockHash | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if config.disk_on:
            assert config.disk_dir is not None
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, fingerprint_id, block_nbytes)

    def start(self) -> list[BlockHash]:
        """Scan the disk tier and start its writer; the blocks found there (announced to the
        listener as the disk's)."""
        if self.disk is None:
            return []
        kept, dropped = self.disk.scan()
        self.stats["disk_scanned_blocks"] = len(kept)
        self.stats["disk_scan_dropped"] = dropped
        with self._lock:
            self._trim_disk()
            kept = [h for h in kept if h in self.disk.files]
            if kept:
                self._notify("disk", kept, [])
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        if dropped:
            logger.warning("disk tier: dropped %d block files that were torn or foreign", dropped)
        return kept

    # -- queries ---------------------------------------------------------------------------

    def medium(self, block_hash: BlockHash) -> str | None:
        """Where a block is: "host" (in memory), "disk", or None."""
        with self._lock:
            if block_hash in self.host or block_hash in self.writing:
                return "host"
            if self.disk is not None and block_hash in self.disk.files:
                return "disk"
        return None

    def depth(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the tiers hold."""
        with self._lock:
            files = self.disk.files if self.disk is not None else {}
            for i, h in enumerate(hashes):
                if h not in self.host and h not in self.writing and h not in files:
                    return i
        return len(hashes)

    def keep_for_load(self, hashes: Sequence[BlockHash]) -> None:
        """Mark the host tier's copies of ``hashes`` the most recently used and keep their
        slots from reuse until ``release``: a load of them allocates pool blocks first, and
        the demotions that allocation causes must not push out the blocks it is about to copy
        (with every other slot held, they go straight to disk). The chain's head last: a load
        stops at its first missing block, so under pressure its tail goes first."""
        with self._lock:
            self.host.touch(hashes)
            self.host.held = {h for h in hashes if h in self.host}

    def release(self) -> None:
        """Let the held slots (``keep_for_load``, ``holding``) be reused again."""
        with self._lock:
            self.host.held = set()

    @contextmanager
    def holding(self, hashes: Sequence[BlockHash]) -> Iterator[list[torch.Tensor | None]]:
        """The blocks' bytes where host memory holds them (None where it does not), not
        copied, their slots kept from reuse inside the ``with``: a promotion allocates pool
        blocks (which may demote others into the host tier) before it copies from them.
        (A pending disk write's bytes are no slot's: nothing reuses them.) Only for the step
        thread, which alone reuses a slot."""
        with self._lock:
            views = [self._in_memory(h) for h in hashes]
            self.host.held = {h for h in hashes if h in self.host}
        try:
            yield views
        finally:
            self.release()

    def memory_view(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block's bytes where host memory holds them, not copied: only for the step
        thread, which alone reuses a slot (demoting), to copy from at once."""
        with self._lock:
            return self._in_memory(block_hash)

    def _in_memory(self, block_hash: BlockHash) -> torch.Tensor | None:
        view = self.host.view(block_hash)
        if view is None and (pending := self.writing.get(block_hash)) is not None:
            return torch.from_numpy(pending)
        return view

    def read(self, block_hash: BlockHash) -> memoryview | None:
        """A copy of the block's bytes from memory or disk; None where they are not whole (a
        torn file is deleted) or their file is gone."""
        with self._lock:
            held = self._in_memory(block_hash)
            if held is not None:
                return memoryview(held.numpy().copy())
            if self.disk is None or block_hash not in self.disk.files:
                return None
        payload = self.disk.read(block_hash)
        with self._lock:
            if block_hash not in self.disk.files:  # evicted while we read: not a corruption
                return None
            if payload is not None:
                self.disk.files.move_to_end(block_hash)
                return payload
            gone = self.disk.discard(block_hash)
            self.stats["disk_missing_blocks" if gone else "disk_corrupt_blocks"] += 1
            self._notify("disk", [], [block_hash])
            first_gone = gone and self.stats["disk_missing_blocks"] == 1
        if gone:  # a directory emptied by hand loses its files one read at a time: said once
            logger.log(logging.WARNING if first_gone else logging.DEBUG, _GONE, self.disk.dir)
        else:
            logger.warning("disk tier: block %s is torn or corrupt; computing it", block_hash.hex())
        return None

    # -- demotion (the step thread) -----------------------------------------------------------

    def demote(
        self, hashes: Sequence[BlockHash], ids: Sequence[int], read_into: BlockCopier
    ) -> None:
        """Blocks the pool is about to reuse: keep a copy (``read_into(block_id, slot)``) in the
        host tier (a block the host tier holds already is only marked used), and move its
        oldest blocks down to disk. Blocks already on disk and not in memory are copied into
        memory again only when the host tier is on. While every host slot is held
        (``holding``) a block goes straight to the disk tier, as without a host tier; a block
        is copied only where it will be kept (not into a full write queue)."""
        stored: list[BlockHash] = []
        victims: list[BlockHash] = []
        with self._lock:
            for h, block_id in zip(hashes, ids, strict=True):
                if h in self.host:
                    self.host.touch([h])
                    continue
                if h in self.writing:
                    continue
                on_disk = self.disk is not None and h in self.disk.files
                taken = self.host.take() if self.host.capacity else None
                if taken is not None:
                    slot, displaced = taken
                    if displaced is not None:
                        victims += self._moved_down(*displaced)
                    read_into(block_id, self.host.slot(slot))
                    self.host.put(h, slot)
                    stored.append(h)
                elif not on_disk and self.disk is not None and self._write_room():
                    payload = torch.empty(self.block_nbytes, dtype=torch.uint8)
                    read_into(block_id, payload)
                    self._queue_write(h, payload.numpy())
                    stored.append(h)
                else:
                    continue
                self.stats["demoted_blocks"] += 1
            stored = [h for h in stored if h in self.host or h in self.writing]
            victims = [h for h in victims if h not in stored]
            if stored or victims:
                self._notify("host", stored, victims)

    def _moved_down(self, h: BlockHash, data: torch.Tensor) -> list[BlockHash]:
        """Block ``h`` left the host tier, its bytes ``data`` still in its slot (the lock is
        held): it is queued for the disk, and stays a host block until written, or leaves
        the tiers (then returned, for the listener)."""
        self.stats["host_evicted_blocks"] += 1
        on_disk = self.disk is not None and h in self.disk.files
        if on_disk or self.disk is None or not self._write_room():
            return [h]
        self._queue_write(h, data.numpy().copy())  # a copy: the slot is reused
        return []

    def _write_room(self) -> bool:
        """Whether the write queue takes one more block (the lock is held); counts a drop."""
        if (len(self.writing) + 1) * self.block_nbytes > self.config.max_pending_write_bytes:
            self.stats["disk_writes_dropped"] += 1
            return False
        return True

    def _queue_write(self, block_hash: BlockHash, payload: np.ndarray) -> None:
        """Queue a disk write (the lock is held; ``_write_room`` said yes)."""
        self.writing[block_hash] = payload
        self._queue.put(block_hash)

    # -- the disk writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        assert self.disk is not None
        while (block_hash := self._queue.get()) is not None:
            try:
                self._write_one(block_hash)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write_one(self, block_hash: BlockHash) -> None:
        assert self.disk is not None
        with self._lock:
            payload = self.writing.get(block_hash)
        if payload is None:
            return
        try:
            self.disk.write(block_hash, payload)
            written = True
        except OSError as e:
            written = False
            with self._lock:
                self.stats["disk_write_errors"] += 1
            if e.errno != errno.ENOSPC or self.stats["disk_write_errors"] == 1:
                logger.warning("disk tier: writing a block failed: %s", e.strerror)
        # The changes and their notices under one lock: the listener hears every tier's
        # changes in the order they happened, whichever thread made them.
        with self._lock:
            del self.writing[block_hash]
            if written:
                self.disk.files[block_hash] = None
                self.stats["disk_written_blocks"] += 1
            evicted = self._trim_disk()
            if written or evicted:
                self._notify("disk", [block_hash] if written else [], evicted)
            if block_hash not in self.host:  # it left memory now (written or not)
                self._notify("host", [], [block_hash])

    def _trim_disk(self) -> list[BlockHash]:
        """Delete the oldest files beyond the disk budget (the lock is held); their hashes."""
        assert self.disk is not None
        evicted = self.disk.trim()
        self.stats["disk_evicted_blocks"] += len(evicted)
        return evicted

    def wait_written(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer has finished every queued block (tests, benches)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self._queue.unfinished_tasks

    def _notify(self, medium: str, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        """Tell the listener (the lock is held: notices keep the order of the changes)."""
        if self.listener is not None:
            self.listener(medium, stored, removed)

    # -- state ---------------------------------------------------------------------------------

    def hashes(self) -> dict[str, list[BlockHash]]:
        """Every block per tier, as the index should know them (blocks being written: host)."""
        with self._lock:
            host = [*self.host, *(h for h in self.writing if h not in self.host)]
            disk = list(self.disk.files) if self.disk is not None else []
        return {"host": host, "disk": disk}

    def get_stats(self) -> dict[str, float]:
        with self._lock:
            host_blocks = len(self.host) + len(self.writing)
            disk_blocks = len(self.disk.files) if self.disk is not None else 0
            disk_bytes = self.disk.used_bytes if self.disk is not None else 0
            return {
                **self.stats,
                "host_blocks": host_blocks,
                "host_bytes": host_blocks * self.block_nbytes,
                "disk_blocks": disk_blocks,
                "disk_bytes": disk_bytes,
            }

    def keep_at_stop(
        self,
        pool_hashes: Sequence[BlockHash],
        pool_ids: Sequence[int],
        read_into: BlockCopier,
        budget_s: float = STOP_WRITE_BUDGET_S,
    ) -> int:
        """The worker stops (its pool no longer changes): write what memory holds to disk, so
        that a restart finds it (only evicted blocks reach disk otherwise): the host tier's
        blocks, then the pool's cached ones (``pool_hashes``, least recently used first, in
        blocks ``pool_ids``, copied by ``read_into``), through ``DiskTier.keep`` within
        ``budget_s``, after the writer's queue. The listener is not told: the worker is
        leaving, and the next scan of its slot announces them. How many were written."""
        deadline = time.monotonic() + budget_s
        self._stop_writer(budget_s)
        if self.disk is None:
            return 0
        with self._lock:
            latest: dict[BlockHash, int | None] = dict.fromkeys(self.host)  # least recent first
            for h, block_id in zip(pool_hashes, pool_ids, strict=True):
                latest.pop(h, None)  # in both: the pool's copy is the more recent use
                latest[h] = block_id
            buf = torch.empty(self.block_nbytes, dtype=torch.uint8)

            def payload(h: BlockHash) -> np.ndarray:
                if (block_id := latest[h]) is None:
                    view = self.host.view(h)
                    assert view is not None  # nothing leaves the host tier at a stop
                    return view.numpy()
                read_into(block_id, buf)
                return buf.numpy()

            blocks = [(h, functools.partial(payload, h)) for h in latest]
            written = self.disk.keep(blocks, deadline)
            self.stats["disk_kept_at_stop"] += written
            left = sum(h not in self.disk.files for h in latest)
        logger.info("disk tier: wrote %d blocks at stop (%d left out: size, time)", written, left)
        return written

    def _stop_writer(self, timeout_s: float) -> None:
        """Finish the queued disk writes (at most ``timeout_s``) and stop the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=timeout_s)
            self._writer = None

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued disk writes (at most ``timeout_s``), stop the writer and let go of
        the disk tier's slot."""
        self._stop_writer(timeout_s)
        if self.disk is not None:
            self.disk.release()
