"""The tiers' tests' common parts: block hashes and payloads, a listener standing for the
index, tiers over a temporary directory, and a pool's copy of a block."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.disk_tier import DiskTier
from kvmesh.workers.kv_cache import host_bytes_tensor
from kvmesh.workers.kv_tiers import KvTiers
from kvmesh.workers.tier_config import TierConfig

FP = "0123456789abcdef"
NBYTES = 64


def h(i: int) -> BlockHash:
    return i.to_bytes(16, "little")


def payload(block_hash: BlockHash) -> bytes:
    return (block_hash * (NBYTES // 16))[:NBYTES]


class Listener:
    """What the index would know: each tier's blocks, from the listener's calls."""

    def __init__(self) -> None:
        self.held: dict[str, set[BlockHash]] = {"host": set(), "disk": set()}

    def __call__(self, medium: str, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        self.held[medium] |= set(stored)
        self.held[medium] -= set(removed)


def tiers(tmp_path: Path, host_blocks: int, disk_blocks: int, **kw) -> tuple[KvTiers, Listener]:
    file_nbytes = DiskTier(str(tmp_path), 0, FP, NBYTES).file_nbytes
    config = TierConfig(
        host_bytes=host_blocks * NBYTES,
        disk_dir=str(tmp_path) if disk_blocks else None,
        disk_bytes=disk_blocks * file_nbytes,
        **kw,
    )
    listener = Listener()
    t = KvTiers(config, FP, NBYTES, listener)
    t.start()
    return t, listener


def copy_block(block_id: int, out: torch.Tensor) -> None:
    """The pool's copy of block ``block_id`` (its KV: ``payload``) into host memory."""
    out.copy_(host_bytes_tensor(payload(h(block_id))))


def demote(t: KvTiers, ids: Sequence[int]) -> None:
    hashes = [h(i) for i in ids]
    t.demote(hashes, list(ids), copy_block)


def settle(t: KvTiers) -> None:
    """Wait for the disk writer to finish what is queued."""
    assert t.wait_written()


def files(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / FP / "slot-0").glob("*/*.kvb")}
