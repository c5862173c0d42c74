"""Three ways to read a prefix's block files back from the disk tier, side by side, cold.

The disk tier writes real block files (``DiskTier.write``: header, checksummed payload) for
N blocks of a model's size (default: smollm2-135m's, 128 blocks = 2048 tokens). Each way then
reads all of them with the page cache of those files dropped first (POSIX_FADV_DONTNEED on
those files only), best of ``--repeats``:

- ``plain_read_gbps``: one thread, ``read_bytes`` per file, no checks (the disk's rate here);
- ``tier_gbps``: the tier loader's path: ``DiskTier.read`` (header and xxh3 checked), 4 files
  at a time (``tiered_connector.DISK_READERS``);
- ``nixl_posix_gbps``: NIXL's POSIX backend: every file registered (FILE), one ``READ`` of all
  payloads into one registered DRAM buffer, then each payload's xxh3 checked (the tier must
  never serve a torn block).

Decides whether the tier's loads should go through NIXL's file backend. Prints one JSON line.

    .venv/bin/python bench/disk_read.py --blocks 128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash
from tier import drop_page_cache

from kvmesh.workers.disk_tier import _HEADER, DiskTier
from kvmesh.workers.tiered_connector import DISK_READERS

SMOLLM2_BLOCK_NBYTES = 30 * 2 * 16 * 3 * 64 * 4  # layers, K/V, block, kv heads, head dim, fp32


def timed(paths: list[Path], nbytes: int, read: callable) -> float:
    drop_page_cache(paths)
    start = time.perf_counter()
    read()
    return nbytes / (time.perf_counter() - start) / 1e9


class NixlPosix:
    """Every block file registered with NIXL's POSIX backend, and a DRAM buffer for them."""

    def __init__(self, paths: list[Path], block_nbytes: int, checksums: list[int]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"kvmesh-disk-read-{os.getpid()}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["POSIX"]))
        if "POSIX" not in self.agent.backends:
            raise RuntimeError("NIXL has no POSIX backend plugin")
        self.n, self.block_nbytes, self.checksums = len(paths), block_nbytes, checksums
        self.buf = torch.empty(self.n * block_nbytes, dtype=torch.uint8)
        self.agent.register_memory(self.buf)
        self.fds = [os.open(p, os.O_RDONLY) for p in paths]
        size = _HEADER.size + block_nbytes
        self.agent.register_memory([(0, size, fd, "") for fd in self.fds], "FILE")
        base = self.buf.data_ptr()
        self.local = self.agent.get_xfer_descs(
            [(base + i * block_nbytes, block_nbytes, 0) for i in range(self.n)], "DRAM"
        )
        self.remote = self.agent.get_xfer_descs(
            [(_HEADER.size, block_nbytes, fd) for fd in self.fds], "FILE"
        )

    def read(self) -> None:
        handle = self.agent.initialize_xfer("READ", self.local, self.remote, self.name)
        state = self.agent.transfer(handle)
        while state == "PROC":
            time.sleep(50e-6)
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL POSIX read: {state}")
        data = self.buf.numpy()
        for i, want in enumerate(self.checksums):
            chunk = data[i * self.block_nbytes : (i + 1) * self.block_nbytes]
            if xxhash.xxh3_64_intdigest(chunk) != want:
                raise RuntimeError(f"block {i} read back wrong")

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block-nbytes", type=int, default=SMOLLM2_BLOCK_NBYTES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where the files go (default: a temporary dir)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvmesh-disk-read-", dir=args.dir))
    try:
        tier = DiskTier(str(root), 1 << 40, "0123456789abcdef", args.block_nbytes)
        tier.claim()
        hashes = [os.urandom(16) for _ in range(args.blocks)]
        payloads = [os.urandom(args.block_nbytes) for _ in range(args.blocks)]
        for h, p in zip(hashes, payloads, strict=True):
            tier.write(h, p)
            tier.files[h] = None
        paths = [tier.path(h) for h in hashes]
        nbytes = args.blocks * args.block_nbytes
        checksums = [xxhash.xxh3_64_intdigest(p) for p in payloads]
        del payloads

        def plain() -> None:
            for p in paths:
                p.read_bytes()

        pool = ThreadPoolExecutor(DISK_READERS)

        def tiered() -> None:
            if any(p is None for p in pool.map(tier.read, hashes)):
                raise RuntimeError("a block file read back torn")

        ways: dict[str, callable] = {"plain_read_gbps": plain, "tier_gbps": tiered}
        nixl_error = None
        try:
            posix = NixlPosix(paths, args.block_nbytes, checksums)
            ways["nixl_posix_gbps"] = posix.read
        except Exception as e:  # no nixl or no POSIX plugin: reported, not fatal
            nixl_error = f"{type(e).__name__}: {e}"
        best = {k: 0.0 for k in ways}
        for _ in range(args.repeats):
            for k, read in ways.items():
                best[k] = max(best[k], timed(paths, nbytes, read))
        pool.shutdown()
        out = {
            "bench": "disk_read",
            "blocks": args.blocks,
            "mb": round(nbytes / 1e6, 1),
            **{k: round(v, 3) for k, v in best.items()},
            "tier_over_plain": round(best["tier_gbps"] / best["plain_read_gbps"], 2),
        }
        if "nixl_posix_gbps" in best:
            out["nixl_posix_over_plain"] = round(
                best["nixl_posix_gbps"] / best["plain_read_gbps"], 2
            )
            posix.close()
        else:
            out["nixl_posix_error"] = nixl_error
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
