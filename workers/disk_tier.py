"""The disk tier: block files in one directory, LRU, checksummed, never served torn.

A block file is a header (magic, format version, the model fingerprint id, the block hash,
the payload's length and its xxh3-64 checksum) and the payload, written to a temporary name
and renamed. A file whose header, length or checksum is wrong (a crash mid-write, a disk
error, another model's block) is never served: reading it deletes it and answers None, and
its tokens are computed. On start the disk tier scans its directory (headers and lengths;
checksums are checked on read) and keeps the blocks of this fingerprint, oldest first.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import threading
from collections import OrderedDict
from pathlib import Path

import xxhash

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.memory_size import gib

logger = logging.getLogger(__name__)

_MAGIC = b"KVMB"
_VERSION = 1
# magic, version, fingerprint id (16 hex chars), block hash, payload length, xxh3-64.
_HEADER = struct.Struct("<4sH16s16sQQ")
_SUFFIX = ".kvb"


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
        self.root = root
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
        """Lock the first free slot of this host's workers (kept until ``release``); a
        directory it cannot use is refused (ValueError naming disk_cache_dir)."""
        try:
            if self._lock_first_free_slot():
                return
        except OSError as e:  # making the directory or a lock file; a held lock is not one
            raise ValueError(
                f"disk_cache_dir: cannot keep the disk tier under {self.root!r}: {e.strerror or e}"
            ) from None
        raise RuntimeError(f"disk tier: every slot under {self.base} is taken")

    def _lock_first_free_slot(self) -> bool:
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
            return True
        return False

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
                remove_file(path)
            else:
                found.append((path.stat().st_mtime, block_hash))
        found.sort()
        for _, block_hash in found:
            self.files[block_hash] = None
        self._check_room()
        return [h for _, h in found], dropped

    def _check_room(self) -> None:
        """Refuses (ValueError naming disk_cache_size, the slot released) a size more than the
        disk's free space plus the tier's own files: it fills lazily, so it would otherwise
        meet a full disk long after the start. (Workers sharing a disk check apart.)"""
        free = shutil.disk_usage(self.dir).free
        if self.capacity > free + self.used_bytes:
            self.release()
            raise ValueError(
                f"disk_cache_size: {gib(self.capacity)} is more than the disk under "
                f"{self.root!r} has free ({gib(free)}, with the tier's own {gib(self.used_bytes)}"
                "); lower it or free space"
            )

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
            remove_file(tmp)
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


def remove_file(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("cannot remove %s: %s", path, e.strerror)
