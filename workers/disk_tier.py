"""The disk tier: block files in one directory, LRU, checksummed, never served torn.

A block file is a header (magic, format version, the model fingerprint id, the block hash,
the payload's length and its xxh3-64 checksum) and the payload, written to a temporary name
and renamed. A file whose header, length or checksum is wrong (a crash mid-write, a disk
error, another model's block) is never served: reading it deletes it and answers None, and
its tokens are computed. On start the disk tier scans its directory (headers and lengths;
checksums are checked on read) and keeps the blocks of this fingerprint, oldest first.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import xxhash

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.files import bytes_under, is_locked, remove_file, same_file
from kvmesh.workers.memory_size import gib

logger = logging.getLogger(__name__)

_MAGIC = b"KVMB"
_VERSION = 1
# magic, version, fingerprint id (16 hex chars), block hash, payload length, xxh3-64.
_HEADER = struct.Struct("<4sH16s16sQQ")
_SUFFIX = ".kvb"


def block_file_nbytes(block_nbytes: int) -> int:
    """Bytes of one block's file: its header and the block."""
    return _HEADER.size + block_nbytes


class DiskTier:
    """Block files under one directory, LRU by the order they were written or read.

    The directory is ``<root>/<fingerprint id>/slot-<k>``: each worker on a host holds the
    first slot whose lock file it can lock (``claim``), for as long as it runs, so workers
    sharing a root never share files, and a worker that replaces a dead one (whose lock the
    OS released) adopts its blocks.

    Workers sharing a root share its disk too. Each records its size beside its slot's lock
    (``slot-<k>.size``), and a starting worker claims and checks its room holding the root's
    ``room.lock``: the free space must hold its own size and what every live slot's tier may
    still fill (its size less its files), whichever model it serves. A slot whose lock no one
    holds (its worker is gone) reserves nothing.
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
        self.root = root
        self.base = Path(root) / fingerprint_id
        self.slot = slot
        self._lock_fd: int | None = None
        self.capacity = capacity
        self.fingerprint = fingerprint_id.encode("ascii")
        self.block_nbytes = block_nbytes
        self.file_nbytes = block_file_nbytes(block_nbytes)
        self.files: OrderedDict[BlockHash, None] = OrderedDict()  # LRU, oldest first

    @property
    def dir(self) -> Path:
        if self.slot is None:
            raise RuntimeError("the disk tier has no slot yet: claim() first")
        return self.base / f"slot-{self.slot}"

    def claim(self) -> None:
        """Lock the first free slot of this host's workers (kept until ``release``); a
        directory it cannot use is refused (ValueError naming disk_cache_dir)."""
        with self._room_turn():
            self._claim()

    def _claim(self) -> None:
        try:
            if self._lock_first_free_slot():
                return
        except OSError as e:  # making the directory or a lock file; a held lock is not one
            raise self._unusable(e) from None
        raise RuntimeError(f"disk tier: every slot under {self.base} is taken")

    def _unusable(self, e: OSError) -> ValueError:
        return ValueError(
            f"disk_cache_dir: cannot keep the disk tier under {self.root!r}: {e.strerror or e}"
        )

    @contextlib.contextmanager
    def _room_turn(self) -> Iterator[None]:
        """The root's workers claim slots and check their room one at a time."""
        try:
            self.base.mkdir(parents=True, exist_ok=True)
            fd = os.open(Path(self.root) / "room.lock", os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise self._unusable(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _lock_first_free_slot(self) -> bool:
        slots = [self.slot] if self.slot is not None else range(1024)
        for k in slots:
            fd = os.open(self.base / f"slot-{k}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self.slot, self._lock_fd = k, fd
            return True
        return False

    def _lock_again(self) -> None:
        """The slot's directory is gone (deleted outside kvmesh), and with the root's contents
        its lock and size files too: lock the slot's lock file anew, so that a worker starting
        now takes another slot, and record the size again. When another worker took the slot
        meanwhile, this one says so and writes there still (checksums keep either from
        serving a file torn by the other)."""
        lock = self.base / f"slot-{self.slot}.lock"
        try:
            with self._room_turn():
                if self._lock_fd is not None and same_file(lock, self._lock_fd):
                    return  # only the slot's directory went; its lock is still this one's
                fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    logger.warning("disk tier: %s was deleted and another worker took it", lock)
                    return
                if self._lock_fd is not None:
                    os.close(self._lock_fd)
                self._lock_fd = fd
                self._size_file.write_text(str(self.capacity))
        except (OSError, ValueError) as e:  # the write that follows says what is wrong
            logger.debug("disk tier: locking %s again failed: %s", lock, e)

    def release(self) -> None:
        if self._lock_fd is not None:
            remove_file(self._size_file)
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = None

    @property
    def _size_file(self) -> Path:
        return self.base / f"slot-{self.slot}.size"

    @property
    def used_bytes(self) -> int:
        return len(self.files) * self.file_nbytes

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + _SUFFIX)

    @property
    def max_files(self) -> int:
        """The most block files its size keeps."""
        return self.capacity // self.file_nbytes

    def trim(self) -> list[BlockHash]:
        """Delete the least recently used files beyond ``max_files``; their hashes."""
        evicted: list[BlockHash] = []
        while len(self.files) > self.max_files:
            evicted.append(self.files.popitem(last=False)[0])
        for block_hash in evicted:
            remove_file(self.path(block_hash))
        return evicted

    def keep(
        self, blocks: Sequence[tuple[BlockHash, Callable[[], np.ndarray]]], deadline: float
    ) -> int:
        """Make ``blocks`` (least recently used first: a hash, and what gives its bytes) the
        most recently used files, as many as the size keeps: those not on disk are written,
        the most recently used first, until ``deadline`` (``time.monotonic``) or a failed
        write, older files beyond the size deleted; then the order of all of them, here and in
        their mtimes (which the next ``scan`` reads), is theirs. How many were written."""
        blocks = blocks[max(0, len(blocks) - self.max_files) :]
        for block_hash, _ in blocks:  # on disk already: ahead of the files not among them
            if block_hash in self.files:
                self.files.move_to_end(block_hash)
        written = 0
        for block_hash, payload in reversed(blocks):
            if block_hash in self.files:
                continue
            if time.monotonic() > deadline:
                break
            try:
                self.write(block_hash, payload())
            except OSError as e:
                logger.warning("disk tier: writing blocks at stop failed: %s", e.strerror)
                break
            self.files[block_hash] = None
            self.trim()
            written += 1
        order = [h for h, _ in blocks if h in self.files]
        for block_hash in order:
            self.files.move_to_end(block_hash)
        self._set_order(order)
        return written

    def _set_order(self, hashes: Sequence[BlockHash]) -> None:
        """Stamp the files of ``hashes`` (least recently used first) with mtimes in that order,
        all from now on, so that the next ``scan`` keeps this order of use."""
        now = time.time_ns()
        for i, block_hash in enumerate(hashes):
            stamp = now + i * 1000  # a microsecond apart
            with contextlib.suppress(OSError):  # gone meanwhile: nothing to order
                os.utime(self.path(block_hash), ns=(stamp, stamp))

    def scan(self) -> tuple[list[BlockHash], int]:
        """Adopt the block files found on disk (oldest first); ``(kept, dropped)``.

        A file is kept when its name, header and length are this model's block's; the rest
        (torn writes, other fingerprints, leftovers of a crash) are deleted. Then the tier's
        room is checked and its size recorded for the root's other workers (the class's docs).
        """
        with self._room_turn():
            if self._lock_fd is None:
                self._claim()
            found, dropped = self._scan_files()
            self._check_room()
            self._size_file.write_text(str(self.capacity))
        return [h for _, h in found], dropped

    def _scan_files(self) -> tuple[list[tuple[int, BlockHash]], int]:
        self.dir.mkdir(parents=True, exist_ok=True)
        found: list[tuple[int, BlockHash]] = []
        dropped = 0
        for path in self.dir.glob("*/*"):
            block_hash = self._check_file(path)
            if block_hash is None:
                dropped += 1
                remove_file(path)
            else:
                found.append((path.stat().st_mtime_ns, block_hash))
        found.sort()
        for _, block_hash in found:
            self.files[block_hash] = None
        return found, dropped

    def _check_room(self) -> None:
        """Refuses (ValueError naming disk_cache_size, the slot released) a size more than the
        disk's free space plus the tier's own files, less what the root's other live tiers may
        still fill: tiers fill lazily, so they would otherwise meet a full disk long after the
        start."""
        free = shutil.disk_usage(self.dir).free
        others = self._others_to_fill()
        if self.capacity + others > free + self.used_bytes:
            self.release()
            their = f", less {gib(others)} the other workers' tiers there may fill"
            raise ValueError(
                f"disk_cache_size: {gib(self.capacity)} is more than the disk under "
                f"{self.root!r} has free ({gib(free)}, with the tier's own {gib(self.used_bytes)}"
                f"{their if others else ''}); lower it or free space"
            )

    def _others_to_fill(self) -> int:
        """Bytes the root's other live slots (any fingerprint) may still write: each one's
        recorded size less its files' bytes."""
        total = 0
        for size_path in Path(self.root).glob("*/slot-*.size"):
            if size_path == self._size_file:
                continue
            if not is_locked(size_path.with_suffix(".lock")):
                continue  # its worker is gone: its replacement will check again
            try:
                capacity = int(size_path.read_text())
            except (OSError, ValueError):
                continue
            total += max(0, capacity - bytes_under(size_path.with_suffix("")))
        return total

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

    def write(self, block_hash: BlockHash, payload: bytes | memoryview | np.ndarray) -> None:
        """Write one block's file (temporary name, then renamed). Raises OSError."""
        if not self.dir.is_dir():
            self._lock_again()
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
            remove_file(tmp)
            raise

    def discard(self, block_hash: BlockHash) -> bool:
        """Forget a block whose file read wrong, and delete the file; whether it was gone
        already (deleted outside kvmesh) rather than torn or corrupt."""
        self.files.pop(block_hash, None)
        path = self.path(block_hash)
        gone = not os.path.exists(path)  # never raises (a directory made unreadable)
        remove_file(path)
        return gone

    def read(self, block_hash: BlockHash) -> memoryview | None:
        """The block's payload when its file is whole and right, else None: read once into
        memory of its own (no copy of the payload after)."""
        data = bytearray(self.file_nbytes)
        try:
            with self.path(block_hash).open("rb") as f:
                if os.fstat(f.fileno()).st_size != self.file_nbytes:
                    return None
                if f.readinto(data) != self.file_nbytes:
                    return None
        except OSError:
            return None
        magic, version, fingerprint, stored_hash, length, checksum = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size :]
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
