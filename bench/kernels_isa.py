"""Decode speed of the CPU kernels' AVX-512 build against their AVX2 + FMA build, same run.

One engine (the GGUF's quantized weights, packed once: both builds read the same panels);
`KVMESH_CPU_ISA` switches the build between runs (workers/cpu_kernels.py reads it at each
call). Per build, alternating which goes first: one request alone (decode tok/s after its
TTFT) and a batch of 16 requests (generated tok/s over the wall time); medians over `--reps`.
Greedy outputs must be equal (the builds agree bit for bit). Prints one JSON line.

    .venv/bin/python bench/kernels_isa.py [--model smollm2-135m] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from kvmesh import LLM, SamplingParams
from kvmesh.workers.cpu_kernels import kernel_library

BUILDS = {"avx512": 512, "avx2": 256}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float]:
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    for isa, bits in BUILDS.items():
        lib = kernel_library(isa)
        if lib is None or lib.kvmesh_isa_bits() != bits:
            raise SystemExit(f"no {isa} build on this machine (see the log)")
    os.environ["KVMESH_CPU_ISA"] = "avx512"
    llm = LLM(args.model, progress=False)
    assert llm.engine.num_quantized_weights > 0, "the model has no quantized weights"
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    single: dict[str, list[float]] = {isa: [] for isa in BUILDS}
    batch: dict[str, list[float]] = {isa: [] for isa in BUILDS}
    tokens: dict[str, list] = {}
    for isa in BUILDS:  # warm up each build
        os.environ["KVMESH_CPU_ISA"] = isa
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))
    for rep in range(args.reps):
        for isa in list(BUILDS)[:: 1 if rep % 2 == 0 else -1]:
            os.environ["KVMESH_CPU_ISA"] = isa
            assert kernel_library().kvmesh_isa_bits() == BUILDS[isa]
            (out,), wall = run(llm, prompts[:1], params)
            single[isa].append((args.new_tokens - 1) / (wall - out.metrics.ttft_s))
            outs, wall = run(llm, prompts, params)
            batch[isa].append(sum(len(o.token_ids) for o in outs) / wall)
            tokens.setdefault(isa, [out.token_ids, *(o.token_ids for o in outs)])

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 2)

    result = {
        "bench": "kernels_isa",
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "avx512_decode_tok_s": med(single["avx512"]),
        "avx2_decode_tok_s": med(single["avx2"]),
        "ratio": round(statistics.median(single["avx512"]) / statistics.median(single["avx2"]), 2),
        f"avx512_batch{args.batch}_gen_tok_s": med(batch["avx512"]),
        f"avx2_batch{args.batch}_gen_tok_s": med(batch["avx2"]),
        "batch_ratio": round(
            statistics.median(batch["avx512"]) / statistics.median(batch["avx2"]), 2
        ),
        "decode_tok_s_runs": {isa: [round(x, 1) for x in xs] for isa, xs in single.items()},
        "outputs_equal": tokens["avx512"] == tokens["avx2"],
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
