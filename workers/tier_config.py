"""The tiers' settings, apart from the tiers (``kv_tiers.py``): read where torch never loads
(the ingress's config checks, an engine config)."""

from __future__ import annotations

from dataclasses import dataclass


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


DEFAULT_DISK_CACHE_SIZE = "4GiB"  # per worker, when disk_cache_dir comes without a size


def host_slots(host_bytes: int, block_nbytes: int) -> int:
    """Blocks the host tier holds: whole blocks of its budget."""
    return host_bytes // block_nbytes


def check_disk_cache_size(size: object, disk_dir: object) -> None:
    """A disk tier's size without its directory would be ignored: a ValueError instead (a
    size of 0, the tier off, is no contradiction)."""
    if size not in (None, 0, "0") and not disk_dir:
        raise ValueError(
            "disk_cache_size: needs disk_cache_dir (the directory of the disk tier); "
            "without one there is no disk tier"
        )
