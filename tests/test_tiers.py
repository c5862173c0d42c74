"""The host and disk tiers themselves: budgets, the disk's files (torn, foreign, full disk),
slots per worker, settings, and a random walk over a pool with both tiers."""

from __future__ import annotations

import errno
import fcntl
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.disk_tier import DiskTier
from kvmesh.workers.kv_cache import KVCache, host_bytes_tensor
from kvmesh.workers.kv_connector import NoopKvCacheConnector
from kvmesh.workers.kv_tiers import KvTiers
from kvmesh.workers.llm import LLM
from kvmesh.workers.memory_size import parse_memory
from kvmesh.workers.model_config import ModelConfig
from kvmesh.workers.request import Request
from kvmesh.workers.tier_config import DEFAULT_DISK_CACHE_SIZE, TierConfig
from kvmesh.workers.tiered_connector import TieredKvConnector
from tests.kv_harness import NAMESPACE, KvHarness

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


def test_budgets_hold_and_the_listener_mirrors_every_tier(tmp_path: Path) -> None:
    t, listener = tiers(tmp_path, host_blocks=4, disk_blocks=6)
    demote(t, range(12))
    settle(t)
    assert list(t.host) == [h(i) for i in range(8, 12)]  # the newest stay in memory
    assert len(t.disk.files) == 6  # the older ones went to disk, the oldest of those deleted
    assert files(tmp_path) == {f"{x.hex()}.kvb" for x in t.disk.files}
    assert listener.held == {m: set(v) for m, v in t.hashes().items()}
    for i in range(12):
        expect = payload(h(i)) if h(i) in t.host or h(i) in t.disk.files else None
        assert t.read(h(i)) == expect
    stats = t.get_stats()
    assert stats["host_blocks"] == 4 and stats["disk_blocks"] == 6
    assert stats["disk_evicted_blocks"] == 2
    t.close()


def test_a_block_in_memory_is_not_copied_again(tmp_path: Path) -> None:
    t, _ = tiers(tmp_path, host_blocks=4, disk_blocks=0)
    demote(t, [1, 2])
    reads: list[int] = []
    t.demote([h(1), h(3)], [1, 3], lambda i, out: reads.append(i) or copy_block(i, out))
    assert reads == [3] and list(t.host) == [h(2), h(1), h(3)]
    t.close()


def pool_and_host_tier(num_blocks: int) -> tuple[KVCache, torch.Tensor, KvTiers]:
    """A real pool of random KV (blocks of 2 tokens) and a host tier of 2 blocks over a slab."""
    model = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=2,
                        num_heads=2, num_kv_heads=2, head_dim=16)  # fmt: skip
    cache = KVCache.allocate(model, num_blocks, 2, torch.float32, torch.device("cpu"))
    cache.data.normal_()
    n = cache.block_bytes_all_layers
    slab = torch.zeros(2 * n, dtype=torch.uint8)
    return cache, slab, KvTiers(TierConfig(host_bytes=2 * n), FP, n, host_memory=slab)


def test_a_block_moves_between_pool_and_host_tier_in_one_copy() -> None:
    """A demotion copies the pool's block straight into its slot of the host tier's slab (on
    a GPU worker, one copy into pinned memory) and a load on the step thread copies from the
    slot itself. Before, ``read_block``'s bytes were copied again into the slot, and a load
    copied the slot into bytes, then into a bytearray, then into the pool."""
    cache, slab, t = pool_and_host_tier(4)
    n = cache.block_bytes_all_layers
    into: list[int] = []

    def read_into(block_id: int, out: torch.Tensor) -> None:
        into.append(out.data_ptr())
        cache.read_block_into(block_id, out)

    conn = TieredKvConnector(NoopKvCacheConnector(), t, read_into, cache.write_block)
    conn.on_evict([h(1)], [1])
    [at] = into
    assert slab.data_ptr() <= at <= slab.data_ptr() + n
    assert t.memory_view(h(1)).data_ptr() == at
    assert slab[at - slab.data_ptr() :][:n].numpy().tobytes() == cache.read_block(1)
    assert conn.start_load(0, [h(1)], [3]).num_blocks == 1
    assert torch.equal(cache.data[:, :, 3], cache.data[:, :, 1])
    conn.close()


def test_a_promotion_copies_each_block_once_from_its_slot() -> None:
    """A peer's pin promotes host-tier blocks into the pool straight from their slots, which
    stay held while the pool allocates for them: the allocation's own evictions, demoted
    into a full host tier, are not kept rather than reuse those slots. Before, each block
    was first copied out into a buffer, then into the pool (2,048 tokens: 50 ms against a
    host load's 8.5 on a 2-core EPYC, bench/tier_copies.py)."""
    cache, slab, t = pool_and_host_tier(6)
    n = cache.block_bytes_all_layers
    sources: list[int] = []

    def writer(block_id: int, data: torch.Tensor) -> None:
        sources.append(data.data_ptr())
        cache.write_block(block_id, data)

    conn = TieredKvConnector(NoopKvCacheConnector(), t, cache.read_block_into, writer)
    conn.on_evict([h(1), h(2)], [1, 2])  # the host tier is full now
    expected = [cache.read_block(1), cache.read_block(2)]

    def allocate(k: int) -> list[int]:
        conn.on_evict([h(10), h(11)], [0, 3])  # the pool reuses two cached blocks for them
        return [0, 3][:k]

    assert conn.promote([h(1), h(2)], allocate) == [0, 3]
    assert [cache.read_block(0), cache.read_block(3)] == expected
    assert all(slab.data_ptr() <= p < slab.data_ptr() + 2 * n for p in sources)
    assert t.medium(h(1)) == t.medium(h(2)) == "host"
    assert t.medium(h(10)) is t.medium(h(11)) is None
    conn.on_evict([h(12)], [4])  # held no longer: its oldest slot is reused again
    assert t.medium(h(12)) == "host" and t.medium(h(1)) is None
    conn.close()


def test_torn_foreign_and_corrupt_files_are_never_served(tmp_path: Path) -> None:
    t, _ = tiers(tmp_path, host_blocks=0, disk_blocks=10)
    demote(t, range(5))
    settle(t)
    t.close()
    disk = DiskTier(str(tmp_path), 0, FP, NBYTES, slot=0)
    torn, corrupt = disk.path(h(0)), disk.path(h(1))
    torn.write_bytes(torn.read_bytes()[:-7])  # a crash mid-write
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in the payload: the header still reads well
    corrupt.write_bytes(bytes(data))
    foreign = DiskTier(str(tmp_path), 0, "fedcba9876543210", NBYTES, slot=0)
    foreign.write(h(9), payload(h(9)))
    moved = disk.path(h(9))  # another model's file under this model's name
    moved.parent.mkdir(parents=True, exist_ok=True)
    moved.write_bytes(foreign.path(h(9)).read_bytes())
    (tmp_path / FP / "slot-0" / "junk.txt").write_text("x")

    t2, listener = tiers(tmp_path, host_blocks=0, disk_blocks=10)
    assert t2.stats["disk_scan_dropped"] == 2  # the torn file and the foreign one
    assert set(t2.disk.files) == {h(1), h(2), h(3), h(4)}
    assert listener.held["disk"] == set(t2.disk.files)
    assert t2.read(h(1)) is None  # the checksum catches it on read
    assert not corrupt.exists() and h(1) not in listener.held["disk"]
    assert t2.get_stats()["disk_corrupt_blocks"] == 1
    assert t2.read(h(2)) == payload(h(2))
    assert foreign.path(h(9)).exists()  # another model's directory is left alone
    t2.close()


def test_workers_sharing_a_directory_take_slots_of_their_own(tmp_path: Path) -> None:
    a, _ = tiers(tmp_path, host_blocks=0, disk_blocks=4)
    b, _ = tiers(tmp_path, host_blocks=0, disk_blocks=4)
    assert (a.disk.slot, b.disk.slot) == (0, 1)
    demote(a, [1])
    demote(b, [2])
    settle(a), settle(b)
    a.close()
    c, listener = tiers(tmp_path, host_blocks=0, disk_blocks=4)  # a's replacement
    assert c.disk.slot == 0 and listener.held["disk"] == {h(1)}
    b.close(), c.close()


def test_a_full_disk_drops_writes_and_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: DiskTier, block_hash: BlockHash, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "write", full)
    t, listener = tiers(tmp_path, host_blocks=2, disk_blocks=10)
    demote(t, range(6))
    settle(t)
    assert t.get_stats()["disk_write_errors"] == 4
    assert not t.disk.files and list(t.host) == [h(4), h(5)]
    assert listener.held == {"host": {h(4), h(5)}, "disk": set()}
    assert t.read(h(0)) is None
    t.close()


def test_a_slow_disk_costs_hits_not_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = __import__("threading").Event()
    real = DiskTier.write

    def slow(self: DiskTier, block_hash: BlockHash, data: bytes) -> None:
        gate.wait(10)
        real(self, block_hash, data)

    monkeypatch.setattr(DiskTier, "write", slow)
    t, _ = tiers(tmp_path, host_blocks=0, disk_blocks=10, max_pending_write_bytes=3 * NBYTES)
    copied: list[int] = []

    def counted(block_id: int, out: torch.Tensor) -> None:
        copied.append(block_id)
        copy_block(block_id, out)

    t.demote([h(i) for i in range(6)], list(range(6)), counted)
    assert len(t.writing) == 3 and t.get_stats()["disk_writes_dropped"] == 3
    assert copied == [0, 1, 2]  # a write the queue drops is not copied first
    gate.set()
    settle(t)
    assert set(t.disk.files) == {h(0), h(1), h(2)}
    t.close()


def test_a_disk_tier_it_cannot_keep_is_refused_naming_the_setting(tmp_path: Path) -> None:
    """A directory it cannot make, or a size more than the disk has free (with the tier's
    own files), refuses the start naming the setting: before, an OSError naming an inner
    path, or a tier that met a full disk later. A refused tier leaves its slot free."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"^disk_cache_dir: cannot keep the disk tier under "
                       r"'.*a-file': Not a directory$"):  # fmt: skip
        LLM("tiny-random", num_kv_blocks=8, disk_cache_dir=str(afile), progress=False)
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"^disk_cache_size: \d+\.\d\d GiB is more than the "
                       r"disk under '.*' has free \("):  # fmt: skip
        LLM("tiny-random", num_kv_blocks=8, disk_cache_dir=str(tmp_path / "t"),
            disk_cache_size=free + 2**30, progress=False)  # fmt: skip
    [lock] = (tmp_path / "t").glob("*/slot-*.lock")  # the refused tier's slot: let go of
    with lock.open() as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_workers_sharing_a_disk_count_each_others_room(tmp_path: Path) -> None:
    """Two tiers under one root whose sizes together pass the disk's free space: the second
    is refused, naming what the first may still fill (before, each checked the free space
    alone and both started, to meet a full disk later). Whichever model the other serves; a
    slot whose worker is gone (lock free, size file left by a crash) reserves nothing."""
    share = shutil.disk_usage(tmp_path).free * 3 // 5
    first = DiskTier(str(tmp_path), share, FP, NBYTES)
    first.scan()
    second = DiskTier(str(tmp_path), share, "fedcba9876543210", NBYTES)
    with pytest.raises(ValueError, match=r"^disk_cache_size: .* less \d+\.\d\d GiB the other "
                       r"workers' tiers there may fill\); lower it or free space$"):  # fmt: skip
        second.scan()
    first.release()  # its worker stops: its room is free again
    crashed = tmp_path / FP / "slot-7.size"
    crashed.write_text(str(share))
    (tmp_path / FP / "slot-7.lock").touch()
    second.scan()
    assert second.slot == 0 and not (tmp_path / FP / "slot-0.size").exists()
    assert (tmp_path / "fedcba9876543210" / "slot-0.size").read_text() == str(share)
    third = DiskTier(str(tmp_path), share, FP, NBYTES)
    with pytest.raises(ValueError, match="other workers' tiers"):
        third.scan()
    second.release()


def test_tier_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="host_cache_memory"):
        LLM("tiny-random", num_kv_blocks=8, host_cache_memory="lots")
    with pytest.raises(ValueError, match="disk_cache_size"):
        TierConfig(disk_bytes=100)


def test_a_disk_size_without_a_directory_is_refused() -> None:
    """``--disk-cache-size`` alone used to serve with no disk tier at all, silently; it is
    refused before anything starts (the CLI and YAML build a ServeConfig, Python an
    EngineConfig), and a directory alone gets the default size."""
    import argparse

    from kvmesh.cluster.config import ServeConfig
    from kvmesh.cluster.serve_flags import add_serve_args, config_from_args
    from kvmesh.workers.engine_config import EngineConfig

    p = argparse.ArgumentParser()
    add_serve_args(p)
    with pytest.raises(ValueError, match=r"^disk_cache_size: needs disk_cache_dir"):
        config_from_args(p.parse_args(["--disk-cache-size", "1GiB"]))
    with pytest.raises(ValueError, match=r"^disk_cache_size: needs disk_cache_dir"):
        EngineConfig(model="tiny-random", disk_cache_size="1GiB")
    assert ServeConfig(disk_cache_dir="/kv").disk_cache_size is None
    assert not EngineConfig(model="tiny-random", disk_cache_size=0).tier_config.disk_on
    assert not EngineConfig(
        model="tiny-random", disk_cache_dir="/kv", disk_cache_size=0
    ).tier_config.disk_on
    tiers = EngineConfig(model="tiny-random", disk_cache_dir="/kv").tier_config
    assert tiers.disk_bytes == parse_memory(DEFAULT_DISK_CACHE_SIZE)


# -- a random walk over the pool and the tiers ----------------------------------------------

MACHINE_PROMPTS = [[p] * 3 + [p + 1, p + 2] * 3 for p in range(0, 50, 10)]  # 4 full blocks each


class TierMachine(RuleBasedStateMachine):
    """Prompts that come back, through a 6-block pool with a 2-block host tier and a 5-block
    disk tier: every request's KV is its own prefix's (``check_kv``), the pool's references
    add up, the budgets hold, and the index's view (the listener) equals the tiers."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvmesh-tiers-")
        self.listener = Listener()

        def make(harness: KvHarness) -> TieredKvConnector:
            nbytes = 16  # the harness's "KV" of a block is its 16-byte hash
            file_nbytes = DiskTier(self.dir, 0, FP, nbytes).file_nbytes
            config = TierConfig(2 * nbytes, self.dir, 5 * file_nbytes)
            t = KvTiers(config, FP, nbytes)
            conn = TieredKvConnector(NoopKvCacheConnector(), t, harness.read_into, harness.write)
            t.listener = self.listener  # in place of the connector's: the index's view
            return conn

        self.h = KvHarness(6, 2, make)
        self.conn = self.h.manager.connector
        self.n = 0

    @rule(i=st.integers(0, len(MACHINE_PROMPTS) - 1), tail=st.lists(st.integers(0, 3)))
    def serve(self, i: int, tail: list[int]) -> None:
        req = self.h.new_request(f"r{self.n}", MACHINE_PROMPTS[i] + tail[:2])
        self.n += 1
        assert self.h.prefill(req) is not None
        self.h.check_kv()
        self.h.finish(req)

    @rule(i=st.integers(0, len(MACHINE_PROMPTS) - 1), n=st.integers(1, 4))
    def peer_pins(self, i: int, n: int) -> None:
        """A peer pins a prompt's first n blocks: what the tiers hold is promoted (host
        blocks from their held slots, disk ones once staged), each pinned block holds its
        own KV, and a refusal takes nothing."""
        chain = Request("pin", MACHINE_PROMPTS[i], 2, NAMESPACE).block_hashes[:n]
        kv, free = self.h.manager, self.h.manager.num_free_blocks
        ids = kv.pin("lease", chain)
        if ids is None and (disk := kv.to_stage(chain, {})):
            ids = kv.pin("lease", chain, self.conn.stage(disk))
        if ids is None:
            assert kv.num_free_blocks == free and not kv.pins
            return
        assert [self.h.memory[b] for b in ids] == chain
        kv.unpin("lease")

    @rule()
    def writer_catches_up(self) -> None:
        settle(self.conn.tiers)
        assert self.listener.held == {m: set(v) for m, v in self.conn.tiers.hashes().items()}
        assert files(Path(self.dir)) == {f"{x.hex()}.kvb" for x in self.conn.tiers.disk.files}

    @rule(i=st.integers(0, 100))
    def tear_a_file(self, i: int) -> None:
        settle(self.conn.tiers)
        paths = sorted((Path(self.dir) / FP / "slot-0").glob("*/*.kvb"))
        if paths:
            path = paths[i % len(paths)]
            path.write_bytes(path.read_bytes()[:-3])

    @invariant()
    def budgets_and_references(self) -> None:
        self.h.manager.check_integrity()
        assert len(self.conn.tiers.host) <= 2 and len(self.conn.tiers.disk.files) <= 5

    def teardown(self) -> None:
        self.conn.close()
        LOADS["host"] += self.conn.stats["host_loaded_blocks"]
        LOADS["disk"] += self.conn.stats["disk_loaded_blocks"]
        LOADS["promoted"] += self.conn.stats["promoted_blocks"]
        shutil.rmtree(self.dir, ignore_errors=True)


LOADS = {"host": 0, "disk": 0, "promoted": 0}
TierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_tier_machine() -> None:
    TierMachine.TestCase("runTest").runTest()
    assert min(LOADS.values()) > 0, LOADS  # the walk loaded from both tiers, and promoted
