"""Small file helpers of the disk tier (``disk_tier.py``): lock files, sizes, removal."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` names the file open as ``fd`` (not a new one made in its place)."""
    try:
        st = path.stat()
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def is_locked(lock_path: Path) -> bool:
    """Whether a process holds an exclusive lock on this lock file (a shared lock on it is
    refused)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def bytes_under(directory: Path) -> int:
    """Bytes of the files one level below ``directory``'s subdirectories."""
    total = 0
    for path in directory.glob("*/*"):
        with contextlib.suppress(OSError):  # removed while counting
            total += path.stat().st_size
    return total


def remove_file(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("cannot remove %s: %s", path, e.strerror)
