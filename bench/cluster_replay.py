"""How few prompt tokens could any placement compute? Replays a `bench/cluster.py --dump`
through bookkeeping-only block pools (no model), so a routing policy or a pool size can be
judged in seconds, and the cluster's number read against floors:

- one_pool: one pool of the cluster's total size (the ideal `bench/cluster.py` compares to);
- recorded: the placement the run's router chose, on separate pools that pull from each other;
- sticky: conversation c always on worker c % workers;
- greedy: an oracle placement: the worker that computes the fewest tokens now (holding or
  pulling the longest prefix), ties to the one hosting the fewest unfinished conversations.

    .venv/bin/python bench/cluster.py --setups kv_aware+connector --dump /tmp/kv.jsonl
    .venv/bin/python bench/cluster_replay.py /tmp/kv.jsonl --blocks 182,200,227
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from pool_replay import cached_depth, replay_computed

from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.chat import chat_prompt_ids
from kvmesh.workers.kv_cache_manager import KVCacheManager
from kvmesh.workers.tokenizer_loader import load_tokenizer

BS = 16
Route = Callable[[int, list[KVCacheManager]], int]


def greedy_route(rows: list[dict], prompts: list[list[int]]) -> Route:
    hosted: dict[int, int] = {}  # unfinished conversation -> pool
    last_turn = {
        r["conversation"]: max(x["turn"] for x in rows if x["conversation"] == r["conversation"])
        for r in rows
    }

    def route(i: int, pools: list[KVCacheManager]) -> int:
        ids, conv = prompts[i], rows[i]["conversation"]
        chain = block_hashes(ids, BS, b"replay")[: (len(ids) - 1) // BS]
        depth = [cached_depth(kv, chain) for kv in pools]
        best = max(depth)
        live = [
            sum(1 for c, p in hosted.items() if p == w and c != conv) for w in range(len(pools))
        ]
        w = min(
            range(len(pools)),
            key=lambda w: (len(chain) - max(depth[w], best), live[w], -depth[w], w),
        )
        hosted[conv] = w
        if rows[i]["turn"] == last_turn[conv]:
            del hosted[conv]
        return w

    return route


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--setup", default="kv_aware+connector")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--blocks", default="182,200,227", help="blocks per worker, comma-separated")
    args = ap.parse_args()

    with open(args.dump) as f:
        rows = [r for r in map(json.loads, f) if r["setup"] == args.setup]
    rows.sort(key=lambda r: r["sent_s"])
    tok = load_tokenizer(args.model)
    prompts = [chat_prompt_ids(tok, r["messages"]) for r in rows]
    requests = [(p, r["token_ids"]) for p, r in zip(prompts, rows, strict=True)]
    names = sorted({r["kvmesh"]["worker"] for r in rows})
    workers = len(names)
    recorded = [names.index(r["kvmesh"]["worker"]) for r in rows]
    out: dict = {
        "bench": "cluster_replay",
        "setup": args.setup,
        "requests": len(rows),
        "measured_computed": sum(r["kvmesh"]["computed_tokens"] for r in rows),
    }
    for nb in map(int, args.blocks.split(",")):
        one = replay_computed(requests, nb * workers, BS)
        res = {
            "one_pool": one,
            "recorded": replay_computed(requests, nb, BS, lambda i, p: recorded[i], workers),
            "sticky": replay_computed(
                requests, nb, BS, lambda i, p: rows[i]["conversation"] % workers, workers
            ),
            "greedy": replay_computed(requests, nb, BS, greedy_route(rows, prompts), workers),
        }
        out[f"blocks_{nb}"] = {
            **res,
            **{f"{k}_vs_one_pool": round(v / one, 3) for k, v in res.items() if k != "one_pool"},
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
