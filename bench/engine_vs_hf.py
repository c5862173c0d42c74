"""kvmesh's engine against HF transformers `generate`, same weights, same run.

16 requests, each a shared 512-token prefix + 32 unique tokens, 64 greedy new tokens (EOS
ignored). kvmesh runs them through continuous batching with prefix caching; HF runs them as
one batch (equal lengths, so no padding). Then one request alone, for prefill and decode
speed. Prints one JSON line.

    .venv/bin/python bench/engine_vs_hf.py [--model smollm2-135m] [--requests 16]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch

from kvmesh import LLM, SamplingParams
from kvmesh.workers.loader import load_weights


def hf_model(model: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    weights = load_weights(model, progress=False)
    cfg = {k: v for k, v in weights.config.to_hf_config().items() if k != "architectures"}
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), torch_dtype=torch.float32)
    hf.load_state_dict(weights.state_dict, strict=False)
    hf.tie_weights()
    return hf.eval()


@torch.inference_mode()
def hf_generate(hf: torch.nn.Module, prompts: list[list[int]], new: int) -> tuple[list, float]:
    ids = torch.tensor(prompts)
    # No EOS at all: min_new_tokens would instead forbid EOS, changing the greedy tokens.
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None
    config.pad_token_id = 0
    t = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        generation_config=config,
        max_new_tokens=new,
        do_sample=False,
    )
    return out[:, ids.shape[1] :].tolist(), time.perf_counter() - t


@torch.inference_mode()
def hf_prefill_s(hf: torch.nn.Module, prompt: list[int]) -> float:
    t = time.perf_counter()
    hf(torch.tensor([prompt]))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--unique-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    llm = LLM(args.model, progress=False)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_tokens)]
    prompts = [
        prefix + [rng.randrange(vocab) for _ in range(args.unique_tokens)]
        for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm up
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    kv_wall = time.perf_counter() - t
    kv_tokens = sum(len(o.token_ids) for o in outs)
    ttfts = [o.metrics.ttft_s for o in outs]

    # One request alone: prefill speed from TTFT, decode speed from the rest.
    llm.engine.kv.reset_prefix_cache()
    t = time.perf_counter()
    single = llm.generate([prompts[0]], params)[0]
    single_wall = time.perf_counter() - t
    single_ttft = single.metrics.ttft_s

    hf = hf_model(args.model)
    hf_out, hf_wall = hf_generate(hf, prompts, args.new_tokens)
    hf_prefill = hf_prefill_s(hf, prompts[0])
    _, hf_single_wall = hf_generate(hf, prompts[:1], args.new_tokens)

    matches = sum(o.token_ids == h for o, h in zip(outs, hf_out, strict=True))
    n_prompt = len(prompts[0])
    result = {
        "bench": "engine_vs_hf",
        "model": args.model,
        "requests": args.requests,
        "prompt_tokens": n_prompt,
        "new_tokens": args.new_tokens,
        "kvmesh_wall_s": round(kv_wall, 3),
        "hf_wall_s": round(hf_wall, 3),
        "kvmesh_gen_tok_s": round(kv_tokens / kv_wall, 2),
        "hf_gen_tok_s": round(kv_tokens / hf_wall, 2),
        "speedup": round(hf_wall / kv_wall, 2),
        "kvmesh_ttft_p50_s": round(statistics.median(ttfts), 3),
        "outputs_match": matches,
        "kvmesh_cached_prompt_tokens": sum(o.metrics.num_local_hit_tokens for o in outs),
        "single_kvmesh_prefill_tok_s": round(n_prompt / single_ttft, 1),
        "single_hf_prefill_tok_s": round(n_prompt / hf_prefill, 1),
        "single_kvmesh_decode_tok_s": round((args.new_tokens - 1) / (single_wall - single_ttft), 2),
        "single_hf_decode_tok_s": round(
            (args.new_tokens - 1) / max(hf_single_wall - hf_prefill, 1e-9), 2
        ),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
