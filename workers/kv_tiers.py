"""Tiers below the device pool: host memory, then local disk, for the blocks the pool evicts.

A block the pool is about to reuse is first copied out (``demote``) into the host tier, a
bounded LRU of block bytes. The host tier's least recently used blocks move down to the disk
tier: a bounded LRU of files in ``<disk_dir>/<fingerprint id>/slot-<k>/``, written by a thread of
its own (a step never waits on a disk). Until its file is written a block stays readable from
memory and counts as a host block. Reads (``read``) come from either tier; a tier hit is
promoted into fresh pool blocks by the connector (``workers/tiered_connector.py``) and keeps
its tier copy, so evicting it again costs no copy.

A block file is a header (magic, format version, the model fingerprint id, the block hash,
the payload's length and its xxh3-64 checksum) and the payload, written to a temporary name
and renamed. A file whose header, length or checksum is wrong (a crash mid-write, a disk
error, another model's block) is never served: reading it deletes it and answers None, and
its tokens are computed. On start the disk tier scans its directory (headers and lengths;
checksums are checked on read) and keeps the blocks of this fingerprint, oldest first.

``listener(medium, stored, removed)`` hears every change of what a tier holds (from the step
thread for the host tier, from the writer thread for the disk), so the index can know it.
Thread-safe: one lock guards the maps; file I/O runs outside it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvmesh.workers.block_hash import BlockHash

logger = logging.getLogger(__name__)

TIERS = ("host", "disk")
TierListener = Callable[[str, list[BlockHash], list[BlockHash]], None]

_MAGIC = b"KVMB"
_VERSION = 1
# magic, version, fingerprint id (16 hex chars), block hash, payload length, xxh3-64.
_HEADER = struct.Struct("<4sH16s16sQQ")
_SUFFIX = ".kvb"


@dataclass(frozen=True)
class TierConfig:
    """Byte budgets of the tiers; a tier with a budget of 0 is off."""

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    # Blocks waiting for the disk writer, in bytes: beyond it a demotion to disk is dropped
    # (counted), so a slow disk costs cache hits, never memory or a step's time.
    max_pending_write_bytes: int = 256 * 1024**2

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "max_pending_write_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("disk_cache_size: needs disk_cache_dir")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_on

    @property
    def disk_on(self) -> bool:
        return bool(self.disk_dir) and self.disk_bytes > 0


class DiskTier:
    """Block files under one directory, LRU by the order they were written or read.

    The directory is ``<root>/<fingerprint id>/slot-<k>``: each worker on a host holds the
    first slot whose lock file it can lock (``claim``), for as long as it runs, so workers
    sharing a root never share files, and a worker that replaces a dead one (whose lock the
    OS released) adopts its blocks.
    """

    def __init__(
        self,
        root: str,
        capacity: int,
        fingerprint_id: str,
        block_nbytes: int,
        slot: int | None = None,
    ) -> None:
        if len(fingerprint_id) != 16:
            raise ValueError(f"fingerprint id must be 16 characters, got {fingerprint_id!r}")
        self.base = Path(root) / fingerprint_id
        self.slot = slot
        self._lock_fd: int | None = None
        self.capacity = capacity
        self.fingerprint = fingerprint_id.encode("ascii")
        self.block_nbytes = block_nbytes
        self.file_nbytes = _HEADER.size + block_nbytes
        self.files: OrderedDict[BlockHash, None] = OrderedDict()  # LRU, oldest first

    @property
    def dir(self) -> Path:
        if self.slot is None:
            raise RuntimeError("the disk tier has no slot yet: claim() first")
        return self.base / f"slot-{self.slot}"

    def claim(self) -> None:
        """Lock the first free slot of this host's workers (kept until ``release``)."""
        self.base.mkdir(parents=True, exist_ok=True)
        slots = [self.slot] if self.slot is not None else range(1024)
        for k in slots:
            fd = os.open(self.base / f"slot-{k}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.slot, self._lock_fd = k, fd
            return
        raise RuntimeError(f"disk tier: every slot under {self.base} is taken")

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = None

    @property
    def used_bytes(self) -> int:
        return len(self.files) * self.file_nbytes

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + _SUFFIX)

    def scan(self) -> tuple[list[BlockHash], int]:
        """Adopt the block files found on disk (oldest first); ``(kept, dropped)``.

        A file is kept when its name, header and length are this model's block's; the rest
        (torn writes, other fingerprints, leftovers of a crash) are deleted.
        """
        if self._lock_fd is None:
            self.claim()
        self.dir.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, BlockHash]] = []
        dropped = 0
        for path in self.dir.glob("*/*"):
            block_hash = self._check_file(path)
            if block_hash is None:
                dropped += 1
                _unlink(path)
            else:
                found.append((path.stat().st_mtime, block_hash))
        found.sort()
        for _, block_hash in found:
            self.files[block_hash] = None
        return [h for _, h in found], dropped

    def _check_file(self, path: Path) -> BlockHash | None:
        if path.suffix != _SUFFIX:
            return None
        try:
            block_hash = bytes.fromhex(path.stem)
            with path.open("rb") as f:
                header = f.read(_HEADER.size)
                size = os.fstat(f.fileno()).st_size
        except (ValueError, OSError):
            return None
        if len(header) != _HEADER.size or size != self.file_nbytes:
            return None
        magic, version, fingerprint, stored_hash, length, _ = _HEADER.unpack(header)
        ok = (magic, version, fingerprint, length) == (
            _MAGIC,
            _VERSION,
            self.fingerprint,
            self.block_nbytes,
        )
        return block_hash if ok and stored_hash == block_hash else None

    def write(self, block_hash: BlockHash, payload: bytes) -> None:
        """Write one block's file (temporary name, then renamed). Raises OSError."""
        path = self.path(block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        checksum = xxhash.xxh3_64_intdigest(payload)
        header = _HEADER.pack(
            _MAGIC, _VERSION, self.fingerprint, block_hash, len(payload), checksum
        )
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        try:
            with tmp.open("wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            raise

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's payload when its file is whole and right, else None."""
        try:
            data = self.path(block_hash).read_bytes()
        except OSError:
            return None
        if len(data) != self.file_nbytes:
            return None
        magic, version, fingerprint, stored_hash, length, checksum = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        ok = (magic, version, fingerprint, stored_hash, length) == (
            _MAGIC,
            _VERSION,
            self.fingerprint,
            block_hash,
            self.block_nbytes,
        )
        if not ok or xxhash.xxh3_64_intdigest(payload) != checksum:
            return None
        return payload


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("cannot remove %s: %s", path, e.strerror)


class KvTiers:
    """The host tier (in memory) and the disk tier below it, with the disk's writer thread."""

    def __init__(
        self,
        config: TierConfig,
        fingerprint_id: str,
        block_nbytes: int,
        listener: TierListener | None = None,
    ) -> None:
        self.config = config
        self.block_nbytes = block_nbytes
        self.listener = listener
        self._lock = threading.Lock()
        self.host: OrderedDict[BlockHash, bytes] = OrderedDict()  # LRU, oldest first
        self.host_capacity = config.host_bytes // block_nbytes  # in blocks
        # Blocks on their way to disk: still readable, and still host blocks to the index.
        self.writing: dict[BlockHash, bytes] = {}
        self.stats = dict.fromkeys(
            (
                "demoted_blocks",
                "host_evicted_blocks",
                "disk_written_blocks",
                "disk_evicted_blocks",
                "disk_write_errors",
                "disk_writes_dropped",
                "disk_corrupt_blocks",
                "disk_scanned_blocks",
                "disk_scan_dropped",
            ),
            0,
        )
        self.disk: DiskTier | None = None
        self._queue: queue.Queue[BlockHash | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if config.disk_on:
            assert config.disk_dir is not None
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, fingerprint_id, block_nbytes)
            self.disk_capacity = config.disk_bytes // self.disk.file_nbytes  # in blocks

    def start(self) -> list[BlockHash]:
        """Scan the disk tier and start its writer; the blocks found there (announced to the
        listener as the disk's)."""
        if self.disk is None:
            return []
        kept, dropped = self.disk.scan()
        self.stats["disk_scanned_blocks"] = len(kept)
        self.stats["disk_scan_dropped"] = dropped
        with self._lock:
            self._delete(self._over_budget())
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

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes from memory or disk (a torn file is deleted: None)."""
        with self._lock:
            payload = self.host.get(block_hash) or self.writing.get(block_hash)
            if payload is not None:
                if block_hash in self.host:
                    self.host.move_to_end(block_hash)
                return payload
            if self.disk is None or block_hash not in self.disk.files:
                return None
        payload = self.disk.read(block_hash)
        with self._lock:
            if block_hash not in self.disk.files:  # evicted while we read: not a corruption
                return None
            if payload is not None:
                self.disk.files.move_to_end(block_hash)
                return payload
            del self.disk.files[block_hash]
            self.stats["disk_corrupt_blocks"] += 1
            _unlink(self.disk.path(block_hash))
            self._notify("disk", [], [block_hash])
        logger.warning("disk tier: block %s is torn or corrupt; computing it", block_hash.hex())
        return None

    # -- demotion (the step thread) -----------------------------------------------------------

    def demote(
        self, hashes: Sequence[BlockHash], ids: Sequence[int], read: Callable[[int], bytes]
    ) -> None:
        """Blocks the pool is about to reuse: keep a copy (``read(block_id)``) in the host tier
        (a block the host tier holds already is only marked used), and move the host tier's
        oldest blocks down to disk. Blocks already on disk and not in memory are copied into
        memory again only when the host tier is on."""
        stored: list[BlockHash] = []
        with self._lock:
            for h, block_id in zip(hashes, ids, strict=True):
                if h in self.host:
                    self.host.move_to_end(h)
                    continue
                if h in self.writing:
                    continue
                on_disk = self.disk is not None and h in self.disk.files
                if self.host_capacity:
                    self.host[h] = read(block_id)
                    stored.append(h)
                elif not on_disk and self.disk is not None:
                    if not self._queue_write(h, read(block_id)):
                        continue
                    stored.append(h)
                else:
                    continue
                self.stats["demoted_blocks"] += 1
            victims = []
            while len(self.host) > self.host_capacity:
                h, payload = self.host.popitem(last=False)
                self.stats["host_evicted_blocks"] += 1
                on_disk = self.disk is not None and h in self.disk.files
                if not on_disk and self.disk is not None and self._queue_write(h, payload):
                    continue  # still a host block until written
                victims.append(h)
            stored = [h for h in stored if h in self.host or h in self.writing]
            if stored or victims:
                self._notify("host", stored, victims)

    def _queue_write(self, block_hash: BlockHash, payload: bytes) -> bool:
        """Queue a disk write (the lock is held); False when the queue is full (dropped)."""
        if (len(self.writing) + 1) * self.block_nbytes > self.config.max_pending_write_bytes:
            self.stats["disk_writes_dropped"] += 1
            return False
        self.writing[block_hash] = payload
        self._queue.put(block_hash)
        return True

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
            evicted = self._over_budget()
            self._delete(evicted)
            if written or evicted:
                self._notify("disk", [block_hash] if written else [], evicted)
            if block_hash not in self.host:  # it left memory now (written or not)
                self._notify("host", [], [block_hash])

    def _over_budget(self) -> list[BlockHash]:
        """Take the oldest files beyond the disk budget out of the map (the lock is held);
        their hashes, for ``_delete``."""
        assert self.disk is not None
        evicted: list[BlockHash] = []
        while len(self.disk.files) > self.disk_capacity:
            evicted.append(self.disk.files.popitem(last=False)[0])
        self.stats["disk_evicted_blocks"] += len(evicted)
        return evicted

    def _delete(self, evicted: list[BlockHash]) -> None:
        assert self.disk is not None
        for h in evicted:
            _unlink(self.disk.path(h))

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

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued disk writes (at most ``timeout_s``) and stop the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=timeout_s)
            self._writer = None
        if self.disk is not None:
            self.disk.release()
