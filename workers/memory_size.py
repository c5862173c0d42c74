"""Memory sizes as people write them ("1GiB", "512MiB", "1.5 GB"): no torch, so the serving
configuration checks them up front."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: str | int) -> int:
    """Bytes from an int or a string such as "1GiB", "512MiB", "1.5 GB", "4096".

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB, or
    K, M, G, T) powers of 1000; case-insensitive. Raises ValueError for anything else or < 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"memory size must be an int or a string like '1GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"memory size must be >= 0, got {value}")
        return value
    m = _MEMORY_RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"cannot parse memory size {value!r}: expected a number and a unit such as "
            "'512MiB', '1GiB' or '2GB'"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def memory_setting(name: str, value: str | int) -> int:
    """``parse_memory`` for the setting ``name``: its ValueError names the setting."""
    try:
        return parse_memory(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def gib(nbytes: int) -> str:
    """Bytes as people read a memory or disk size in a message: "1.50 GiB"."""
    return f"{nbytes / 1024**3:.2f} GiB"


def size_text(nbytes: int) -> str:
    """Bytes in the largest binary unit they fill, as in a message: "2.0 KiB", "4.5 MiB"."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
