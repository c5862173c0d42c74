"""A worker's KV cache: sized from its settings, checked, then allocated (``allocate_kv_cache``);
and whether its memory fits where it goes, checked before it is allocated.

A KV pool (and a host tier) larger than the memory free for it does not fail where it is
set: on CPU, torch refuses only what exceeds the machine's RAM and swap, with an allocator
message that names no setting; below that the zero-filled pool takes the machine's (or the
container's) last memory, and the kernel's OOM killer, a container's memory limit or Ray's
memory monitor ends the worker later, which Serve then replaces, again and again. Checked
first, the worker refuses to start with a ValueError that names the setting, which
``kvmesh serve`` prints as the reason its worker failed to start.

Free memory: on CUDA, what the device reports free; on the host, what the machine has
available (``psutil``), or less where this process's memory cgroup (a container, a pod, a
systemd unit; v1 or v2) leaves less below its limit. A cgroup's usage counts its page cache
too, of which the inactive part is reclaimable: it is left out, as the kubelet's working set
leaves it out.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from kvmesh.workers.disk_tier import block_file_nbytes
from kvmesh.workers.engine_config import EngineConfig, context_len
from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.memory_size import gib, parse_memory, size_text
from kvmesh.workers.model_config import ModelConfig
from kvmesh.workers.tier_config import host_slots

logger = logging.getLogger(__name__)
# One per machine (or /tmp): workers starting together each check and allocate in turn.
LOCK_PATH = Path(tempfile.gettempdir()) / "kvmesh-kv-memory.lock"
CGROUP_FS = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def cgroup_room(fs: Path = CGROUP_FS, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes this process's memory cgroup and its ancestors can still take: the least room
    below any limit on the way up (None: no limit, or no cgroup to read)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and (fs / "cgroup.controllers").exists():  # v2, one hierarchy
            return _room(fs, path, "memory.max", "memory.current", "inactive_file")
        if "memory" in controllers.split(","):  # v1's memory hierarchy
            base = fs / "memory"
            return _room(base, path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                         "total_inactive_file")  # fmt: skip
    return None


def _room(base: Path, path: str, limit_file: str, usage_file: str, inactive: str) -> int | None:
    here = base / path.lstrip("/")
    if not here.is_dir():  # a cgroup namespace: the mount's root is this process's cgroup
        here = base
    rooms = []
    while True:
        room = _room_of(here, limit_file, usage_file, inactive)
        if room is not None:
            rooms.append(room)
        if here == base or base not in here.parents:
            break
        here = here.parent
    return max(min(rooms), 0) if rooms else None


def _room_of(cgroup: Path, limit_file: str, usage_file: str, inactive: str) -> int | None:
    try:
        limit_text = (cgroup / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        usage = int((cgroup / usage_file).read_text())
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None  # the root has no limit file; an unreadable one limits nothing we know
    return int(limit_text) - (usage - int(stat.get(inactive, 0)))


def free_memory(device: torch.device) -> tuple[int, str]:
    """The bytes free for new memory on ``device`` and where, in words, for messages."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # Blocks torch's caching allocator holds unused (freed while the weights loaded) are
        # not free to the driver, but are to the pool.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"{device} has free"
    available = psutil.virtual_memory().available
    room = cgroup_room()
    if room is not None and room < available:
        return room, "this process's memory limit (its container or cgroup) leaves"
    return available, "this machine has available"


@contextlib.contextmanager
def kv_memory_turn(path: Path = LOCK_PATH) -> Iterator[None]:
    """This machine's workers check free memory and allocate their pools one at a time:
    workers that start together (``--workers 2`` on one node) would otherwise each see the
    memory the other is about to take, both pass, and one be killed later. The pool is
    zero-filled, and so is the host tier's slab: their pages are taken when the turn ends."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as e:  # another user's lock file: go on without turns
        logger.debug("no turn for the KV memory check (%s)", e)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_kv_memory(
    device: torch.device, pool_bytes: int, pool_setting: str, host_tier_bytes: int
) -> None:
    """Refuses (ValueError, naming the settings) a pool, with the host tier on CPU, larger than
    the memory free where it goes; a GPU worker's host tier is checked against the host."""
    host = [(host_tier_bytes, "host_cache_memory")] if host_tier_bytes else []
    if device.type == "cuda":
        _check(device, [(pool_bytes, pool_setting)])
        if host:
            _check(torch.device("cpu"), host)
    else:
        _check(device, [(pool_bytes, pool_setting), *host])


def _check(device: torch.device, parts: list[tuple[int, str]]) -> None:
    free, words = free_memory(device)
    if sum(n for n, _ in parts) > free:
        (nbytes, setting), *more = sorted(parts, reverse=True)  # the largest leads
        asked = gib(nbytes) + "".join(f" with {other}'s {gib(n)}" for n, other in more)
        raise ValueError(
            f"{setting}: {asked} is more than {words} ({gib(free)}); lower it or free memory"
        )


def allocate_kv_cache(
    config: EngineConfig, model: ModelConfig, kv_dtype: torch.dtype, device: torch.device
) -> tuple[KVCache, torch.Tensor | None, int]:
    """The worker's KV cache, sized from its settings and refused (ValueError naming the
    setting) with no block, with a context it cannot hold or in memory that is not free; its
    host tier's memory (None: no host tier); and the context it serves."""
    num_blocks = config.num_kv_blocks or KVCache.num_blocks_for_memory(
        model, config.block_size, kv_dtype, parse_memory(config.kv_cache_memory)
    )
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: {config.kv_cache_memory!r} holds no block of "
            f"{config.block_size} tokens for this model"
        )
    check_tiers_hold_a_block(config, KVCache.nbytes_for(model, 1, config.block_size, kv_dtype))
    max_model_len = context_len(config, model.max_position_embeddings, num_blocks)
    with kv_memory_turn():
        check_kv_memory(
            device,
            KVCache.nbytes_for(model, num_blocks, config.block_size, kv_dtype),
            "num_kv_blocks" if config.num_kv_blocks else "kv_cache_memory",
            config.tier_config.host_bytes,
        )
        cache = KVCache.allocate(model, num_blocks, config.block_size, kv_dtype, device)
        host = host_tier_memory(config.tier_config.host_bytes, cache.block_bytes_all_layers, device)
    return cache, host, max_model_len


def check_tiers_hold_a_block(config: EngineConfig, block_nbytes: int) -> None:
    """Refuses (ValueError naming the setting) a tier that is on but holds no whole block: it
    would keep nothing, and every block meant for it would be computed again."""
    tiers = config.tier_config
    for setting, value, budget, need in (
        ("host_cache_memory", config.host_cache_memory, tiers.host_bytes, block_nbytes),
        (
            "disk_cache_size",
            config.disk_cache_size,
            tiers.disk_bytes,
            block_file_nbytes(block_nbytes),
        ),
    ):
        if 0 < budget < need:
            raise ValueError(
                f"{setting}: {value!r} holds no block of {config.block_size} tokens for this "
                f"model (one takes {size_text(need)}); raise it, or set 0 for no such tier"
            )


def host_tier_memory(
    host_bytes: int, block_nbytes: int, device: torch.device
) -> torch.Tensor | None:
    """The host tier's slab (``KvTiers``): whole blocks, zero-filled so that its pages are
    taken now, in the worker's turn, and pinned on a GPU worker, so that a demotion is one copy
    from the device straight into its slot (``KVCache.read_block_into``). None without a host
    tier."""
    slots = host_slots(host_bytes, block_nbytes)
    if slots == 0:
        return None
    return torch.zeros(slots * block_nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
