"""What prompt logprobs (completions' echo with logprobs) cost: the time to a first token of an
uncached prompt without them, with ``prompt_logprobs=0`` and with ``prompt_logprobs=5``, side by
side. They add the logits of every prompt position (a [256, V] slice at a time), the
log-softmax and, for N > 0, a top-N. Prefix caching is off, so every run computes its prompt.

One JSON line: for each prompt length, the median milliseconds of ``--rounds`` runs of each.

    .venv/bin/python bench/prompt_logprobs.py [--model smollm2-135m] [--lengths 512,2048]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvmesh import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_kv_blocks=800, progress=False, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    kinds = {"none": None, "n0": 0, "n5": 5}
    result: dict[str, object] = {"bench": "prompt_logprobs", "model": args.model}
    for length in (int(x) for x in args.lengths.split(",")):
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.rounds):  # interleaved, so a slow moment hits every kind
            for kind, n in kinds.items():
                ids = [rng.randrange(10, vocab) for _ in range(length)]
                t = time.perf_counter()
                llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=n))
                times[kind].append(time.perf_counter() - t)
        for kind, ts in times.items():
            result[f"ms_{kind}_p{length}"] = round(statistics.median(ts) * 1e3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
