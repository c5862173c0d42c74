"""The quantized matmul (csrc/qmatmul.c) against MKL's float32 GEMM, by rows of x, same run.

One decoder layer's four matmuls of a model's shapes (fused q/k/v, o, fused gate/up, down) as
Q4_1 panels, against `F.linear` over float32 weights of the same shapes: milliseconds per
layer and the share of the CPU's float32 FMA peak (`--peak-gflops` per thread: 2 FMA units x
8 lanes x the clock; 51.2 for a 3.2 GHz AVX2 core), medians over `--reps`. Rows: 1 is a
decode alone, 8-16 a decode batch or a short prefill beside it, 64+ a prefill chunk. Prints
one JSON line.

    .venv/bin/python bench/qmatmul_rows.py [--model smollm2-135m] [--rows 1,8,16,64,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvmesh.workers.loader import load_weights
from kvmesh.workers.qmatmul import BLOCK_WEIGHTS, QuantizedWeight, pack, qmatmul

Q4_1, Q4_1_BYTES = 3, 20


def random_q4_1(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """Random Q4_1 blocks whose scales are small normal halves (no inf or NaN)."""
    blocks = torch.randint(0, 256, (n, k // BLOCK_WEIGHTS, Q4_1_BYTES), dtype=torch.uint8,
                           generator=gen)  # fmt: skip
    blocks[:, :, 0:4] = torch.tensor([0x00, 0x20, 0x00, 0xA0], dtype=torch.uint8)  # d, m
    return QuantizedWeight(Q4_1, blocks.reshape(n, -1).contiguous(), k)


def per_layer_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,4,8,12,16,32,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-gflops", type=float, default=51.2, help="float32 FMA/s per thread")
    args = ap.parse_args()

    c = load_weights(args.model, progress=False).config
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    shapes = [(qkv, h), (h, h), (2 * i, h), (h, i)]
    gen = torch.Generator().manual_seed(0)
    packed = [pack(random_q4_1(n, k, gen)) for n, k in shapes]
    dense = [torch.randn(n, k, generator=gen) for n, k in shapes]
    threads = torch.get_num_threads()
    peak = args.peak_gflops * threads
    out: dict[str, object] = {"bench": "qmatmul_rows", "model": args.model,
                              "shapes": shapes, "threads": threads}  # fmt: skip
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k, generator=gen) for _, k in shapes]
        fmas = sum(m * n * k for n, k in shapes)
        pairs_q = list(zip(xs, packed, strict=True))
        pairs_f = list(zip(xs, dense, strict=True))
        q_ms = per_layer_ms(lambda: [qmatmul(x, w) for x, w in pairs_q], args.reps)  # noqa: B023
        f_ms = per_layer_ms(lambda: [F.linear(x, w) for x, w in pairs_f], args.reps)  # noqa: B023
        out[f"m{m}"] = {
            "qmatmul_ms": round(q_ms, 3),
            "float32_ms": round(f_ms, 3),
            "qmatmul_of_peak": round(fmas / (q_ms * 1e6) / peak, 3),
            "float32_of_peak": round(fmas / (f_ms * 1e6) / peak, 3),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
