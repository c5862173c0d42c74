"""Decode speed against context length: a step of `--requests` decodes over contexts of each
length, none shared (so no cascade: every decode reads its own KV).

Per context length: milliseconds a decode step (median of `--steps`), tokens/s, and the KV
bytes the step's attention must read over the step time (`kv_gb_s`, a lower bound on the
attention's own read rate) next to this machine's read rate (`read_gb_s`: a 256 MiB tensor
summed on the same threads), so the step can be held against the memory roofline. One JSON
line. Run it from an older checkout's code too to compare (BENCHMARKS.md says how).

    .venv/bin/python bench/decode_context.py [--model smollm2-135m] [--contexts 512,2048]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvmesh import SamplingParams
from kvmesh.workers.engine import LLMEngine
from kvmesh.workers.engine_config import EngineConfig


def read_gb_s() -> float:
    x = torch.ones(64 * 1024 * 1024)
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    return x.numel() * 4 * 5 / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    need = args.requests * (max(contexts) + args.steps + 8)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            num_kv_blocks=-(-need // 16) + 16,
            max_num_batched_tokens=4096,
            progress=False,
        )
    )
    kv_token_bytes = engine.kv_cache.block_bytes_all_layers // engine.config.block_size
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    result: dict[str, object] = {"bench": "decode_context", "model": args.model,
                                 "requests": args.requests, "threads": args.threads}  # fmt: skip
    for ctx in contexts:
        params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
        ids = [
            engine.add_request([rng.randrange(10, vocab) for _ in range(ctx)], params)
            for _ in range(args.requests)
        ]
        produced = dict.fromkeys(ids, 0)
        while min(produced.values()) < 2:  # every prompt computed, every request decoding
            for delta in engine.step():
                produced[delta.request_id] += 1
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        while engine.has_unfinished():
            engine.step()
        step = statistics.median(times)
        kv_bytes = args.requests * (ctx + 2) * kv_token_bytes
        result[f"step_ms_{ctx}"] = round(step * 1e3, 2)
        result[f"tok_s_{ctx}"] = round(args.requests / step, 1)
        result[f"kv_gb_s_{ctx}"] = round(kv_bytes / step / 1e9, 2)
    result["read_gb_s"] = round(read_gb_s(), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
