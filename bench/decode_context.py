"""Decode speed against context length: a step of `--requests` decodes over contexts of each
length, none shared (so no cascade: every decode reads its own KV).

Per context length: milliseconds a decode step (median of `--steps`), tokens/s, and the KV
bytes the step's attention must read over the step time (`kv_gb_s`, a lower bound on the
attention's own read rate) next to this machine's read rate (`read_gb_s`: a 256 MiB tensor
summed on the same threads), so the step can be held against the memory roofline. One JSON
line, with a run per KV cache dtype (`--kv-cache-dtypes auto,bfloat16`: the same prompts,
one engine after the other) and how many requests' greedy tokens equal the first run's. Run it
from an older checkout's code too to compare (BENCHMARKS.md says how).

    .venv/bin/python bench/decode_context.py [--model smollm2-135m] [--contexts 512,2048]
        [--kv-cache-dtypes auto,bfloat16]
"""

from __future__ import annotations

import argparse
import gc
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


def measure(args: argparse.Namespace, contexts: list[int], kv_cache_dtype: str) -> dict:
    """One engine with this cache dtype: its step times per context, and every request's
    generated tokens (the same prompts for every dtype)."""
    need = args.requests * (max(contexts) + args.steps + 8)
    dtype_arg = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            num_kv_blocks=-(-need // 16) + 16,
            max_num_batched_tokens=4096,
            progress=False,
            **dtype_arg,  # not passed by default: older commits' code (at_commit.py) lacks it
        )
    )
    kv_token_bytes = engine.kv_cache.block_bytes_all_layers // engine.config.block_size
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    run: dict[str, object] = {"kv_token_bytes": kv_token_bytes}
    out: dict[str, list[int]] = {}  # request id -> its generated tokens

    def step() -> None:
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids

    for ctx in contexts:
        params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
        ids = [
            engine.add_request([rng.randrange(10, vocab) for _ in range(ctx)], params)
            for _ in range(args.requests)
        ]
        out.update((i, []) for i in ids)
        while min(len(out[i]) for i in ids) < 2:  # every prompt computed, every one decoding
            step()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        while engine.has_unfinished():
            step()
        step_s = statistics.median(times)
        kv_bytes = args.requests * (ctx + 2) * kv_token_bytes
        run[f"step_ms_{ctx}"] = round(step_s * 1e3, 2)
        run[f"tok_s_{ctx}"] = round(args.requests / step_s, 1)
        run[f"kv_gb_s_{ctx}"] = round(kv_bytes / step_s / 1e9, 2)
    run["tokens"] = list(out.values())  # in the order added
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma-separated, run in turn: e.g. auto,bfloat16 (auto: the model's dtype)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    result: dict[str, object] = {"bench": "decode_context", "model": args.model,
                                 "requests": args.requests, "threads": args.threads}  # fmt: skip
    runs = {}
    for kv_cache_dtype in args.kv_cache_dtypes.split(","):
        runs[kv_cache_dtype] = measure(args, contexts, kv_cache_dtype)
        gc.collect()  # the previous engine's cache, before the next one allocates its own
    first = next(iter(runs.values()))["tokens"]
    for run in runs.values():
        # Greedy tokens against the first dtype's, request by request.
        same = [a == b for a, b in zip(run.pop("tokens"), first, strict=True)]
        run["requests_same_tokens"] = f"{sum(same)}/{len(same)}"
    result["runs"] = runs
    result["read_gb_s"] = round(read_gb_s(), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
