"""A GGUF file's metadata keys, read without numpy arrays, torch or any tensor: what a front end
needs to build the file's tokenizer (tokenizer_loader.py).

transformers' own GGUF reader imports torch at its top, and `gguf.GGUFReader` parses every
array into numpy views (~2 s and ~200 MB for SmolLM2-135M's 49,152-token vocabulary); an
ingress replica needs neither. Format: github.com/ggml-org/ggml/blob/master/docs/gguf.md
(versions 2 and 3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# value type -> struct format of one scalar (GGUF's type codes)
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path, string_arrays: Container[str] = ()) -> dict[str, Any]:
    """Every metadata key of the GGUF at `path` with its value: scalars, strings, arrays of
    numbers as lists; an array of strings as a list only when its key is in `string_arrays`
    (a vocabulary, a merge table), else as its length. Raises ValueError when the file is not
    a GGUF this reader understands, or is cut short."""
    with open(path, "rb") as f:
        try:
            blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF file (empty)") from e
    with blob:
        try:
            return _read(blob, path, string_arrays)
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"{path} is not a readable GGUF file: truncated or corrupt") from e


def _read(blob: mmap.mmap, path: Path, string_arrays: Container[str]) -> dict[str, Any]:
    if blob[:4] != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    version, _tensors, count = struct.unpack_from("<IQQ", blob, 4)
    if version not in VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; kvmesh reads versions 2 and 3")
    pos, metadata = 24, {}
    for _ in range(count):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind, key in string_arrays, path)
    return metadata


def _value(blob: mmap.mmap, pos: int, kind: int, keep: bool, path: Path) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"{path} holds a metadata value of unknown type {kind}")
    element, n = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element in _SCALARS:
        fmt = _SCALARS[element]
        size = struct.calcsize(fmt) * n
        return list(struct.unpack_from(f"<{n}{fmt[1]}", blob, pos)), pos + size
    if element != _STRING:
        raise ValueError(f"{path} holds a metadata array of type {element}")
    if keep:
        values = []
        for _ in range(n):
            value, pos = _string(blob, pos)
            values.append(value)
        return values, pos
    for _ in range(n):  # variable-length entries: walk past them
        pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
    return n, pos


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + n
    if end > len(blob):
        raise IndexError("string past the end of the file")
    return blob[pos + 8 : end].decode("utf-8"), end
