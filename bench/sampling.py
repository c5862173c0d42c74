"""What sampling costs a step: `sample` (inverse CDF, one uniform a row) against the exponential
race it replaced (argmax p / Exp(1), a draw per vocabulary entry), side by side.

One JSON line: for each batch size, milliseconds a step for both, over smollm2's vocabulary
(49,152) at temperature 1, on this process's torch threads; what ``penalize`` adds when every
row asks for every penalty and a logit bias (``penalties_ms_b*``: a 2,000-token prompt and 500
output tokens a row) and when rows ask for only the presence penalty (``presence_ms_b*``);
with ``--engine`` also the engine's
decode throughput (tokens/s) at temperature 1 (the OpenAI API's default) with each sampler,
``--streams`` requests of 64 new tokens on smollm2.

    .venv/bin/python bench/sampling.py [--vocab 49152] [--batches 1,8,64] [--threads 2]
    .venv/bin/python bench/sampling.py --engine [--streams 8,32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch

from kvmesh.workers.penalties import penalize
from kvmesh.workers.sampler import position_seed, sample
from kvmesh.workers.sampling_params import SamplingParams


def exponential_race(logits: torch.Tensor, seeds: list[int], positions: list[int]) -> list[int]:
    """The sampler before (temperature 1, no top-k / top-p)."""
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for j, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        noise[j].exponential_(generator=torch.Generator().manual_seed(position_seed(seed, pos)))
    return (probs / noise).argmax(dim=-1).tolist()


def per_step_ms(fn, args: tuple, reps: int) -> float:
    fn(*args)
    t = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - t) / reps * 1e3


def old_sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """`sample` as it was, for temperature-only rows (what the engine bench sends)."""
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    return exponential_race(logits / temps, list(seeds), list(positions))


def engine_tokens_per_s(streams: int, sampler: Callable[..., list[int]]) -> float:
    """Decode throughput of `streams` sampled requests, 64 new tokens each, with `sampler`."""
    import kvmesh.workers.engine as engine_module
    from kvmesh.workers.llm import LLM

    global _llm
    if _llm is None:
        _llm = LLM("smollm2-135m", kv_cache_memory="256MiB", progress=False)
    engine_module.sample = sampler
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=1)
    prompts = [f"Story number {i}: once upon a time" for i in range(streams)]
    t = time.perf_counter()
    outs = _llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


_llm = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help="also the engine's decode tokens/s")
    ap.add_argument("--streams", default="8,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, object] = {"bench": "sampling", "vocab": args.vocab, "threads": args.threads}
    p = SamplingParams(temperature=1.0)
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b, args.vocab) * 3
        seeds, positions = list(range(b)), [5] * b
        reps = max(3, 200 // b)
        new = per_step_ms(sample, (logits, [p] * b, seeds, positions), reps)
        old = per_step_ms(exponential_race, (logits, seeds, positions), reps)
        result[f"inverse_cdf_ms_b{b}"] = round(new, 3)
        result[f"exponential_race_ms_b{b}"] = round(old, 3)
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(args.vocab, (2000,), generator=g).tolist() for _ in range(b)]
        outputs = [torch.randint(args.vocab, (500,), generator=g).tolist() for _ in range(b)]
        every = SamplingParams(
            presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
            logit_bias={i: 1.0 for i in range(8)},
        )  # fmt: skip
        for name, q in (("penalties", every), ("presence", SamplingParams(presence_penalty=1))):
            ms = per_step_ms(penalize, (logits, [q] * b, prompts, outputs), reps)
            result[f"{name}_ms_b{b}"] = round(ms, 3)
    if args.engine:
        for n in (int(x) for x in args.streams.split(",")):
            engine_tokens_per_s(n, sample)  # warm-up: the first batch pays for allocations
            result[f"engine_tok_s_inverse_cdf_{n}"] = round(engine_tokens_per_s(n, sample), 1)
            old = engine_tokens_per_s(n, old_sample)
            result[f"engine_tok_s_exponential_race_{n}"] = round(old, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
