"""The disk tier's files: torn, foreign and corrupt files never served, slots per worker, a
full or slow disk, and the settings a disk cannot keep (its room shared with other workers)."""

from __future__ import annotations

import errno
import fcntl
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.disk_tier import DiskTier
from kvmesh.workers.llm import LLM
from tests.tier_helpers import FP, NBYTES, copy_block, demote, files, h, payload, settle, tiers


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


def test_files_deleted_outside_kvmesh_are_counted_as_gone_not_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator empties the cache directory while the worker runs: every read of a vanished
    file is a miss (its tokens computed) and leaves the index. Before, each was logged and
    counted as torn or corrupt (``disk_corrupt_blocks``: a failing disk, to whoever watches
    /metrics). Now they count as gone, with one warning, and the next writes make the
    directory again."""
    t, listener = tiers(tmp_path, host_blocks=0, disk_blocks=10)
    demote(t, range(4))
    settle(t)
    shutil.rmtree(tmp_path / FP)
    with caplog.at_level("DEBUG", logger="kvmesh.workers.kv_tiers"):
        assert [t.read(h(i)) for i in range(4)] == [None] * 4
    stats = t.get_stats()
    assert (stats["disk_missing_blocks"], stats["disk_corrupt_blocks"]) == (4, 0)
    assert not t.disk.files and not listener.held["disk"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "deleted outside kvmesh" in warnings[0], warnings
    demote(t, [5])
    settle(t)
    assert t.read(h(5)) == payload(h(5))
    t.close()


def test_a_slot_whose_directory_was_deleted_is_locked_again(tmp_path: Path) -> None:
    """The cache directory emptied by hand takes the slot's lock file with it: before, the
    worker went on writing into a slot no lock guarded, and a worker starting next took the
    same slot (the two would trim each other's files). Now the next write locks it again."""
    a, _ = tiers(tmp_path, host_blocks=0, disk_blocks=4)
    assert a.disk.slot == 0
    shutil.rmtree(tmp_path / FP)
    demote(a, [1])
    settle(a)
    b, _ = tiers(tmp_path, host_blocks=0, disk_blocks=4)  # a worker that starts now
    assert (a.disk.slot, b.disk.slot) == (0, 1)
    assert a.read(h(1)) == payload(h(1))
    demote(a, [2])  # a slot whose lock is still its own: locked once, not again
    settle(a)
    assert a.read(h(2)) == payload(h(2))
    a.close()
    b.close()


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
    gate = threading.Event()
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


def test_blocks_demoted_while_every_host_slot_is_held_go_to_disk(tmp_path: Path) -> None:
    """A promotion holds host slots (``holding``) while its allocation demotes other blocks:
    with every slot held those go straight to the disk tier, as without a host tier. Before,
    they were dropped although the disk had room, and their tokens computed again later."""
    t, listener = tiers(tmp_path, host_blocks=2, disk_blocks=8)
    demote(t, [1, 2])
    with t.holding([h(1), h(2)]) as views:
        demote(t, [3, 4])
        assert [bytes(v.numpy()) for v in views] == [payload(h(1)), payload(h(2))]
    settle(t)
    assert [t.medium(h(i)) for i in (1, 2, 3, 4)] == ["host", "host", "disk", "disk"]
    assert listener.held == {"host": {h(1), h(2)}, "disk": {h(3), h(4)}}
    assert [bytes(t.read(h(i))) for i in (3, 4)] == [payload(h(3)), payload(h(4))]
    demote(t, [5])  # held no longer: the oldest slot moves down as ever
    settle(t)
    assert [t.medium(h(i)) for i in (1, 5)] == ["disk", "host"]
    t.close()


def test_a_stop_writes_what_memory_holds_in_its_order_of_use(tmp_path: Path) -> None:
    """At a stop the host tier's blocks and the pool's are written to disk (before, only
    evicted blocks reached it, and a restart computed the rest again), as many as the disk
    keeps, the most recently used kept; the next start's scan finds them in that order."""
    t, _ = tiers(tmp_path, host_blocks=2, disk_blocks=3)
    demote(t, [1, 2, 3])  # the host tier keeps 2 and 3, 1 goes down to disk
    settle(t)
    # The pool holds 3 (loaded back: its use now the latest), 4 and 5, the most recent.
    assert t.keep_at_stop([h(3), h(4), h(5)], [3, 4, 5], copy_block) == 3
    t.close()
    # Used in the order 1, 2, 3, 4, 5: the disk keeps the last three, 1 gave way, 2 was left.
    again, listener = tiers(tmp_path, host_blocks=0, disk_blocks=3)
    assert again.disk is not None and list(again.disk.files) == [h(3), h(4), h(5)]
    assert listener.held["disk"] == {h(3), h(4), h(5)}
    assert [bytes(again.read(h(i)) or b"") for i in (3, 4, 5)] == [payload(h(i)) for i in (3, 4, 5)]
    again.close()


def test_a_stop_out_of_time_keeps_the_most_recently_used(tmp_path: Path) -> None:
    """A stop's writes run out of time (each pool copy takes longer than the budget here):
    the one written is the most recently used block, not the least."""
    t, _ = tiers(tmp_path, host_blocks=0, disk_blocks=8)

    def slow_copy(block_id: int, out: torch.Tensor) -> None:
        time.sleep(0.1)
        copy_block(block_id, out)

    assert t.keep_at_stop([h(3), h(4), h(5)], [3, 4, 5], slow_copy, budget_s=0.05) == 1
    t.close()
    assert files(tmp_path) == {f"{h(5).hex()}.kvb"}


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
