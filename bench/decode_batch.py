"""Decode step time against batch size: where a step's cost jumps as requests join.

On CPU the Q4_1 / Q8_0 matmul (csrc/qmatmul.c) takes at most 8 rows a pass with AVX2 (16
with AVX-512), and each pass dequantizes every weight it reads: a ninth token in a step takes
a second pass (since 4 rows or fewer take both halves of a panel at once, a cheaper one than
it was). One engine, greedy
requests of short prompts decoding; for each batch size the median milliseconds of a step
and the step time per request, side by side, in one JSON line.

    .venv/bin/python bench/decode_batch.py [--model smollm2-135m] [--batches 1,4,8,9,12,16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvmesh import SamplingParams
from kvmesh.workers.cpu_kernels import kernel_library
from kvmesh.workers.engine import LLMEngine
from kvmesh.workers.engine_config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,4,8,9,12,16,17")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = sorted(int(b) for b in args.batches.split(","))
    engine = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=800, progress=False))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    lib = kernel_library()
    result: dict[str, object] = {
        "bench": "decode_batch",
        "model": args.model,
        "threads": args.threads,
        "isa_bits": lib.kvmesh_isa_bits() if lib is not None else None,
    }
    running = 0
    for b in batches:
        while running < b:  # requests join; earlier ones keep decoding
            engine.add_request([rng.randrange(10, vocab) for _ in range(32)], params)
            running += 1
        for _ in range(3 if running > batches[0] else 15):  # prompts in; the first warms up
            engine.step()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        step_ms = statistics.median(times) * 1e3
        result[f"step_ms_b{b}"] = round(step_ms, 1)
        result[f"ms_per_request_b{b}"] = round(step_ms / b, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
