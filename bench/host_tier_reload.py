"""A prompt comes back to a worker whose host tier is smaller than the prompt: how much of it
loads from host memory, how much from disk, and what its allocation writes to disk.

One engine in process (no Ray): a pool that holds about one prompt, a host tier of
``--host-cache-memory`` and a disk tier in a temporary directory. Prompt A is computed, then
prompt B (A's blocks are demoted: the newest into host memory, the rest to disk), then A
again. A's second run loads its blocks from the tiers; its allocation demotes B's blocks, which
must not push out the host blocks A is loading. One JSON line: A's tokens by where they came
from on its second run, its TTFT, and the blocks written to disk and evicted from the host
tier during that run.

    .venv/bin/python bench/host_tier_reload.py
    .venv/bin/python bench/at_commit.py REV bench/host_tier_reload.py   # older code
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from kvmesh import LLM, SamplingParams


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 20000 for i in range(n)]


def settle(llm: LLM) -> None:
    """Until the disk writer has nothing queued (its counters stop moving)."""
    last = None
    for _ in range(200):
        stats = llm.engine.kv.connector.get_stats()
        now = (stats.get("disk_written_blocks"), stats.get("host_blocks"))
        if now == last:
            return
        last = now
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--kv-cache-memory", default="32MiB")
    p.add_argument("--host-cache-memory", default="16MiB")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-reload-") as disk:
        llm = LLM(
            args.model,
            kv_cache_memory=args.kv_cache_memory,
            host_cache_memory=args.host_cache_memory,
            disk_cache_dir=disk,
            disk_cache_size="1GiB",
            progress=False,
        )
        greedy = SamplingParams(max_tokens=4, temperature=0)
        a, b = prompt(1, args.prompt_tokens), prompt(2, args.prompt_tokens)
        first = llm.generate([a], greedy)[0]
        llm.generate([b], greedy)
        settle(llm)
        before = llm.engine.kv.connector.get_stats()
        again = llm.generate([a], greedy)[0]
        settle(llm)
        after = llm.engine.kv.connector.get_stats()
        m = again.metrics
        print(
            json.dumps(
                {
                    "bench": "host_tier_reload",
                    "prompt_tokens": len(a),
                    "kv_cache_memory": args.kv_cache_memory,
                    "host_cache_memory": args.host_cache_memory,
                    "host_hit_tokens": m.num_host_hit_tokens,
                    "disk_hit_tokens": m.num_disk_hit_tokens,
                    "local_hit_tokens": m.num_local_hit_tokens,
                    "computed_tokens": m.num_computed_tokens,
                    "ttft_s": round(m.ttft_s, 4),
                    "first_ttft_s": round(first.metrics.ttft_s, 4),
                    "disk_written_blocks": after["disk_written_blocks"]
                    - before["disk_written_blocks"],
                    "host_evicted_blocks": after["host_evicted_blocks"]
                    - before["host_evicted_blocks"],
                    "same_output": again.token_ids == first.token_ids,
                }
            )
        )
        llm.close()


if __name__ == "__main__":
    main()
