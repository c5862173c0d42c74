"""A KV pool larger than the memory free for it is refused before it is allocated, naming the
setting: in a real memory cgroup (a container's limit) and against the machine's memory;
and the cgroup files read as the kernel writes them, v1 and v2."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from subprocess import PIPE

import psutil
import pytest
import torch

from kvmesh import LLM
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.memory_room import cgroup_room, check_kv_memory, free_memory

MIB, GIB = 1024**2, 1024**3


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A v1 memory cgroup of its own below this process's, limited to `limit` bytes (skips
    where there is none to make: no v1 memory hierarchy, or not root)."""
    line = next(
        (x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x), None
    )
    base = Path("/sys/fs/cgroup/memory")
    if line is None or not base.is_dir():
        pytest.skip("no cgroup v1 memory hierarchy here")
    own = base / line.split(":", 2)[2].lstrip("/")
    made = (own if own.is_dir() else base) / f"kvmesh-test-{uuid.uuid4().hex[:8]}"
    try:
        made.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        (made / "memory.limit_in_bytes").write_text(str(limit))
        yield made
    finally:
        for pid in (made / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        with contextlib.suppress(OSError):
            made.rmdir()


def test_a_pool_over_the_containers_limit_is_refused_naming_it() -> None:
    """1 GiB of KV in a cgroup limited to 768 MiB: before, the zero-filled pool met the
    limit and the kernel killed the worker (SIGKILL, no word of why); now a ValueError."""
    code = (
        "from kvmesh import LLM\n"
        "LLM(model='tiny-random', kv_cache_memory='1GiB', progress=False)\n"
        "print('started')\n"
    )
    with memory_cgroup(768 * MIB) as cgroup:
        out = subprocess.run(
            ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -c "$1"',
             sys.executable, code],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: kv_cache_memory: 1.00 GiB is more than this process's "
                           "memory limit (its container or cgroup) leaves ("), last  # fmt: skip


def start_two_together(limit: int, settings: str) -> str:
    """Two ``LLM(model='tiny-random', <settings>)`` processes started at once in a memory
    cgroup limited to ``limit``: one must start and the other be refused; the refused one's
    last line."""
    code = (
        "import time\n"
        "from kvmesh import LLM\n"
        f"LLM(model='tiny-random', progress=False, {settings})\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    with memory_cgroup(limit) as cgroup:
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -c "$1"',
               sys.executable, code]  # fmt: skip
        procs = [subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True) for _ in range(2)]
        try:
            lines = [p.stdout.readline() for p in procs]  # type: ignore[union-attr]
        finally:
            for p in procs:
                p.kill()  # the one that started; the refused one has exited
            errs = [p.communicate(timeout=30)[1] for p in procs]
    assert sorted(lines) == ["", "started\n"], (lines, [p.returncode for p in procs], errs)
    refused = lines.index("")
    assert procs[refused].returncode == 1, (procs[refused].returncode, errs[refused][-2000:])
    return errs[refused].strip().splitlines()[-1]


def test_workers_starting_together_take_turns() -> None:
    """Two workers start at once in a cgroup with room for one pool: one starts and the other
    is refused, naming the setting. Before the turns, both saw room for their pool, both
    zero-filled it, and the kernel killed one (SIGKILL)."""
    last = start_two_together(1536 * MIB, "kv_cache_memory='600MiB'")
    assert last.startswith("ValueError: kv_cache_memory: 0.59 GiB is more than this process's "
                           "memory limit"), last  # fmt: skip


def test_host_tiers_starting_together_take_turns() -> None:
    """The same with host tiers: each worker's tier fits alone, not both. Before the tier's
    slab was allocated at start, both passed the check (the first one's tier still empty)
    and both started, to meet the limit once their tiers filled."""
    last = start_two_together(1536 * MIB, "kv_cache_memory='16MiB', host_cache_memory='600MiB'")
    assert last.startswith("ValueError: host_cache_memory: 0.59 GiB with kv_cache_memory's "
                           "0.02 GiB is more than this process's memory limit"), last  # fmt: skip


def test_a_pool_and_host_tier_over_the_machines_memory_are_refused() -> None:
    """Against the machine's own available memory, the host tier counted with the pool on
    CPU; a pool that fits starts."""
    twice = 2 * psutil.virtual_memory().total
    with pytest.raises(ValueError, match=r"^kv_cache_memory: \d+\.\d\d GiB is more than") as e:
        LLM(model="tiny-random", kv_cache_memory=twice, progress=False)
    assert "this machine has available" in str(e.value) or "memory limit" in str(e.value)
    # The largest leads: the host tier fills lazily, so it counts whole from the start.
    both = r"^host_cache_memory: \d+\.\d\d GiB with kv_cache_memory's 0\.06 GiB is more"
    with pytest.raises(ValueError, match=both):
        check_kv_memory(torch.device("cpu"), 64 * MIB, "kv_cache_memory", twice)
    with pytest.raises(ValueError, match=r"^num_kv_blocks: "):
        check_kv_memory(torch.device("cpu"), twice, "num_kv_blocks", 0)
    check_kv_memory(torch.device("cpu"), 64 * MIB, "kv_cache_memory", 64 * MIB)
    free, _ = free_memory(torch.device("cpu"))
    assert 0 < free <= psutil.virtual_memory().total
    with pytest.raises(ValueError, match=r"^kv_cache_memory: cannot parse memory size '-1'"):
        EngineConfig(model="tiny-random", kv_cache_memory="-1")  # named before: just the size


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_cgroup_room_reads_v2_and_v1_with_their_ancestors(tmp_path: Path) -> None:
    """The least room below a limit on the way up; inactive page cache is reclaimable; a
    cgroup namespace (the path not under the mount) reads the mount's root."""
    v2, proc = tmp_path / "v2", tmp_path / "cgroup"
    _write(v2, {
        "cgroup.controllers": "cpu memory\n",
        "pod/memory.max": f"{4 * GIB}\n", "pod/memory.current": f"{3 * GIB}\n",
        "pod/memory.stat": f"anon 1\ninactive_file {GIB}\n",
        "pod/app/memory.max": "max\n", "pod/app/memory.current": "5\n",
        "pod/app/memory.stat": "inactive_file 0\n",
    })  # fmt: skip
    proc.write_text("0::/pod/app\n")
    assert cgroup_room(v2, proc) == 2 * GIB  # the pod's limit, less its working set
    (v2 / "pod/app/memory.max").write_text(f"{GIB}\n")
    assert cgroup_room(v2, proc) == GIB - 5  # the nearer, tighter limit
    proc.write_text("0::/elsewhere/in/the/host\n")
    assert cgroup_room(v2, proc) is None  # the mount's root: no limit file
    v1 = tmp_path / "v1"
    _write(v1, {
        "memory/c/memory.limit_in_bytes": f"{2 * GIB}\n",
        "memory/c/memory.usage_in_bytes": f"{GIB}\n",
        "memory/c/memory.stat": f"cache 9\ntotal_inactive_file {GIB // 2}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.usage_in_bytes": "1\n", "memory/memory.stat": "total_inactive_file 0\n",
    })  # fmt: skip
    proc.write_text("5:cpu:/c\n4:memory:/c\n")
    assert cgroup_room(v1, proc) == 2 * GIB - GIB // 2
    proc.write_text("5:cpu:/\n")
    assert cgroup_room(v1, proc) is None  # no memory controller
