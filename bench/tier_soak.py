"""Tiers under faults: conversations on three workers whose pools are too small for them, with
host and disk tiers, while a busy worker replica is killed (or, every third time, the index
actor) every ``--kill-every-s``.

Each of ``--conversations`` conversations (token ids, tiny-random) grows by its answer and 8
new tokens a turn, and starts again below 440 tokens; every round sends one turn of each, 6 at
a time, through the Serve handle. A worker's pool holds 512 tokens (``--kv-cache-memory``),
its host tier 256 and its disk tier 4,096, so histories move down to the tiers and come back
from them, or from a peer's pool or tiers, or are computed. The outputs are checked against an
in-process engine (greedy). A replacement adopts its dead predecessor's disk slot.

One JSON line: ``requests``, ``failed``, ``wrong`` (an output unlike the engine's), the
prompt tokens by where they came from (``local_hit``, ``host_hit``, ``disk_hit``, ``pulled``,
``computed``: the responses' ``kvmesh`` object summed), ``migrations``, the faults, and the
workers alive at the end: their pulls and failed pulls (``pull_failures``: a holder that
refused, the puller computed instead), and the leases and pinned blocks left (0).

    .venv/bin/python bench/tier_soak.py [--seconds 150]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # bench.*, tests.*

from bench.chaos_common import index_actor  # noqa: E402
from kvmesh import SamplingParams  # noqa: E402
from tests.serve_helpers import (  # noqa: E402
    busy_worker,
    kill_worker,
    redeploy,
    running_replicas,
    tiny_config,
    tiny_reference,
    undeploy,
    wait_for,
)

SOURCES = {
    "local_hit": "local_hit_tokens",
    "host_hit": "host_hit_tokens",
    "disk_hit": "disk_hit_tokens",
    "pulled": "pulled_tokens",
    "computed": "computed_tokens",
    "migrations": "migrations",
}
RESTART_BELOW = 440  # tokens: a longer history starts again (the pool caps a context at 512)


class Conversations:
    """The conversations, their turns through the app, and the tally."""

    def __init__(self, handle: Any, n: int, max_tokens: int) -> None:
        self.handle, self.max_tokens = handle, max_tokens
        self.rng = random.Random(1)
        self.histories = [self._fresh() for _ in range(n)]
        self.reference = tiny_reference()
        self.reference_lock, self.lock = threading.Lock(), threading.Lock()
        self.tally = {"requests": 0, "failed": 0, "wrong": 0, **dict.fromkeys(SOURCES, 0)}
        self.errors: list[str] = []

    def _fresh(self) -> list[int]:
        return [self.rng.randrange(3, 250) for _ in range(40)]

    def turn(self, i: int) -> None:
        ids = self.histories[i]
        body = {"prompt": ids, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        try:
            out = self.handle.generate.remote(body).result(timeout_s=120)
        except Exception as e:  # a request lost: the figure this bench exists for
            with self.lock:
                self.tally["requests"] += 1
                self.tally["failed"] += 1
                self.errors.append(f"{type(e).__name__}: {e}"[:300])
            return
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        with self.reference_lock:
            want = self.reference.generate([ids], params)[0].token_ids
        with self.lock:
            self.tally["requests"] += 1
            self.tally["wrong"] += out["token_ids"] != want
            for name, field in SOURCES.items():
                self.tally[name] += out["kvmesh"].get(field) or 0
            grown = ids + out["token_ids"] + [self.rng.randrange(3, 250) for _ in range(8)]
            self.histories[i] = grown if len(grown) < RESTART_BELOW else self._fresh()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--kill-every-s", type=float, default=15.0)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="256KiB")  # 128 blocks of 4 tokens
    args = p.parse_args()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    disk = tempfile.mkdtemp(prefix="kvmesh-tier-soak-")
    config = tiny_config(workers=3, kv_cache_memory=args.kv_cache_memory,
                         host_cache_memory="128KiB", disk_cache_dir=disk,
                         disk_cache_size="2MiB", max_model_len=480)  # fmt: skip
    handle = redeploy(config)
    talk = Conversations(handle, args.conversations, args.max_tokens)
    faults = {"worker_kills": 0, "index_kills": 0}
    sending = ThreadPoolExecutor(6)
    start = time.monotonic()
    next_fault = start + args.kill_every_s
    while time.monotonic() - start < args.seconds:
        order = list(range(args.conversations))
        talk.rng.shuffle(order)
        turns = [sending.submit(talk.turn, i) for i in order]
        if time.monotonic() >= next_fault:
            next_fault += args.kill_every_s
            if (faults["worker_kills"] + faults["index_kills"]) % 3 == 2:
                ray.kill(index_actor(), no_restart=False)
                faults["index_kills"] += 1
            else:
                time.sleep(0.3)  # the round's requests reach their workers
                victim = busy_worker(handle)
                if victim is not None:
                    kill_worker(victim)
                    faults["worker_kills"] += 1
        for t in turns:
            t.result()
    wait_for(lambda: running_replicas() == 3, 120, "three workers again")
    time.sleep(5.0)  # the last pulls' leases end
    stats = handle.stats.remote().result()
    workers = ray.get(index_actor().workers.remote())
    left = [(ray.get(m["handle"].num_leases.remote()), ray.get(m["handle"].num_pinned.remote()))
            for m in workers.values()]  # fmt: skip
    print(json.dumps({
        "bench": "tier_soak",
        "seconds": round(time.monotonic() - start, 1),
        **talk.tally,
        **faults,
        "pulls": stats.get("pulls"),
        "pull_failures": stats.get("pull_failures"),
        "leases_left": sum(lease for lease, _ in left),
        "pinned_left": sum(pinned for _, pinned in left),
        "errors": talk.errors[:3],
    }), flush=True)  # fmt: skip
    sending.shutdown()
    undeploy()
    ray.shutdown()


if __name__ == "__main__":
    main()
