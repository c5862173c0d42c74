"""Shared by the KvIndex tests: chained block hashes, an index whose calls carry each
worker's token, and a trivially correct lookup to check the index against."""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import xxhash

from kvmesh.connector.events import EventBatch, Stored, encode_batch
from kvmesh.connector.kv_index import KvIndex

FP = "fp-test"


def chain(root: bytes, n: int, branch: int = 0) -> list[bytes]:
    """``n`` chained 16-byte hashes under ``root``; another ``branch`` gives another chain."""
    out, parent = [], root
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + bytes([branch, i]))
        out.append(parent)
    return out


BASE = chain(b"root", 12)
FORK4 = BASE[:4] + chain(BASE[3], 8, branch=1)  # shares 4 blocks with BASE
FORK8 = BASE[:8] + chain(BASE[7], 4, branch=2)  # shares 8 blocks with BASE


def batch(w: str, seq: int, *events) -> bytes:
    return encode_batch(EventBatch(w, seq, tuple(events)))


class Index(KvIndex):
    """A KvIndex whose calls carry each worker's own token, as its connector's do (these tests
    are about events; tokens are tested in test_peer_hardening.py)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tokens: dict[str, str] = {}

    def register(self, worker_id, fingerprint, metadata=None, token=None) -> str:
        token = super().register(worker_id, fingerprint, metadata, self.tokens.get(worker_id))
        self.tokens[worker_id] = token
        return token

    def apply(self, data, token=None):
        return super().apply(data, self.tokens)

    def apply_snapshot(self, worker_id, hashes, next_seq, token=None, tiers=None) -> None:
        super().apply_snapshot(worker_id, hashes, next_seq, self.tokens.get(worker_id), tiers)


def index_with(**held: list[bytes]) -> KvIndex:
    """An index where each keyword worker holds the given hashes (one Stored each)."""
    idx = Index(FP)
    for w, hashes in held.items():
        idx.register(w, FP)
        assert idx.apply(batch(w, 0, Stored(tuple(hashes)))).status == "applied"
    return idx


class CountingSeq(Sequence):
    """A read-only sequence that records which indexes were read."""

    def __init__(self, items: list[bytes]) -> None:
        self.items = items
        self.read: set[int] = set()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        self.read.add(i)
        return self.items[i]


def pack(*obj) -> bytes:
    return msgpack.packb(list(obj), use_bin_type=True)


def model_lookup(held: dict[str, set[bytes]], q: list[bytes], exclude=None) -> dict[str, int]:
    out = {}
    for w, s in held.items():
        n = 0
        while n < len(q) and q[n] in s:
            n += 1
        if n and w != exclude:
            out[w] = n
    return out
