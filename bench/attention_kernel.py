"""The paged attention kernel alone (workers/csrc/paged_attention.c), on the shapes where its
`lanes` path runs: decodes of models with 7 or more query heads a KV head, and a short suffix
over a long cached prefix (the pulled request of bench/pull_stall.py); smollm2's decodes
(3 query heads a KV head, its `rows` path) over 2,048 keys and over 256 (K/V in cache).

Per case: milliseconds a layer (median of `--reps` passes over `--layers` layers' caches,
each its own memory, so K/V come from memory as in a model), and a digest of the output's
bytes: a change that is meant to keep the kernel's numerics must keep the digests. Run it
from an older commit too (bench/at_commit.py) and compare both, in one sitting. One JSON line.

    .venv/bin/python bench/attention_kernel.py [--isa avx512|avx2] [--threads 2]
    .venv/bin/python bench/at_commit.py COMMIT bench/attention_kernel.py
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import statistics
import time

import torch

from kvmesh.workers.cpu_kernels import kernel_library

BLOCK_SIZE, HEAD_DIM = 16, 64
# name -> (query heads, KV heads, one item's (new tokens, keys) per row)
CASES = {
    "decode_g3": (9, 3, [(1, 2048)] * 8),  # smollm2: `rows`
    "decode_g3_256": (9, 3, [(1, 256)] * 8),  # the same at a chat's length: K/V in cache
    "decode_g7": (28, 4, [(1, 2048)] * 8),  # Qwen2.5-7B's shape
    "decode_g8": (16, 2, [(1, 2048)] * 8),  # Llama-3-70B's 64 / 8
    "suffix_8_over_2056_g3": (9, 3, [(8, 2056)]),  # pull_stall's pulled request, alone
}


def run_case(
    lib: ctypes.CDLL, hq: int, hkv: int, rows: list[tuple[int, int]], args: argparse.Namespace
) -> dict:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    nblocks = [-(-keys // BLOCK_SIZE) for _, keys in rows]
    ids = list(range(sum(nblocks)))
    rng.shuffle(ids)  # a pool's blocks lie anywhere
    shape = (sum(nblocks), BLOCK_SIZE, hkv, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(args.layers)
    ]
    blocks, kv_len, bo, qo, nq, qtok, qlim = [], [], [], [], [], [], []
    for (new, keys), nb in zip(rows, nblocks, strict=True):
        bo.append(len(blocks))
        blocks += ids[len(blocks) : len(blocks) + nb]
        kv_len.append(keys)
        qo.append(len(qtok))
        nq.append(new)
        qlim += [keys - new + i + 1 for i in range(new)]  # causal
        qtok += range(len(qtok), len(qtok) + new)
    arrays = [torch.tensor(x, dtype=torch.int32) for x in (blocks, kv_len, bo, qo, nq, qtok, qlim)]
    q = torch.randn(len(qtok), hq, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    digest = hashlib.sha256()
    times = []
    for rep in range(args.reps):
        t = time.perf_counter()
        for k, v in caches:
            rc = lib.kva_paged_attention(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), arrays[0].data_ptr(),
                len(qtok), hq, hkv, HEAD_DIM, BLOCK_SIZE, len(rows),
                *(a.data_ptr() for a in arrays[1:]), HEAD_DIM**-0.5, args.threads, 0,
            )  # fmt: skip
            assert rc == 0
            if rep == 0:
                digest.update(out.numpy().tobytes())
        times.append(time.perf_counter() - t)
    return {"ms_a_layer": round(statistics.median(times) / args.layers * 1e3, 3),
            "digest": digest.hexdigest()[:16]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default=None, help="avx512 or avx2 (default: the best here)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    lib = kernel_library(args.isa)
    if lib is None:
        raise SystemExit("the CPU kernels are not available here (see the log)")
    result: dict[str, object] = {"bench": "attention_kernel", "isa_bits": lib.kvmesh_isa_bits(),
                                 "threads": args.threads}  # fmt: skip
    for name, (hq, hkv, rows) in CASES.items():
        result[name] = run_case(lib, hq, hkv, rows, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
