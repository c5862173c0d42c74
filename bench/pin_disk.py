"""A holder's side of a pull from its disk tier, in process: ``Worker.pin`` of a prefix the
worker keeps only on disk (the files read and checked off the step thread, then promoted
into the pool), timed alone, without Ray, NIXL or a peer.

smollm2-135m, a 128 MiB pool (182 blocks of 16 tokens; peers may pin 91) and a disk tier.
Each trial computes a new 2,056-token prompt, then two more that push it out to disk, and
pins the first ``--blocks`` blocks of its chain. One JSON line: each trial's ``pin_s``, the
blocks pinned and the holder's total ``promote_s``. Old code beside it:
``bench/at_commit.py REV bench/pin_disk.py``.

    .venv/bin/python bench/pin_disk.py [--trials 4] [--blocks 90]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling_params import SamplingParams
from kvmesh.workers.worker import Worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--blocks", type=int, default=90)
    args = p.parse_args()
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(2056)]

    with tempfile.TemporaryDirectory() as disk:
        cfg = EngineConfig("smollm2-135m", kv_cache_memory="128MiB", disk_cache_dir=disk,
                           disk_cache_size="2GiB", progress=False)  # fmt: skip
        worker = Worker("holder", cfg)
        one = SamplingParams(max_tokens=1)
        namespace = worker.engine.fingerprint.namespace
        tiers = worker.kv.connector.tiers
        pin_s, pinned = [], []
        for _ in range(args.trials):
            ids = prompt()
            worker.generate(ids, one)
            for _ in range(2):  # two more prompts push it out of the pool, onto disk
                worker.generate(prompt(), one)
            tiers.wait_written()
            hashes = block_hashes(ids, cfg.block_size, namespace)[: args.blocks]
            assert {tiers.medium(h) for h in hashes} == {"disk"}
            started = time.perf_counter()
            lease = worker.pin(hashes, 10.0)
            pin_s.append(round(time.perf_counter() - started, 4))
            pinned.append(len(lease[1]) if lease else 0)
            if lease:
                worker.release(lease[0])
        stats = worker.kv.connector.get_stats()
        worker.shutdown()
    print(json.dumps({"bench": "pin_disk", "pin_s": pin_s, "pinned": pinned,
                      "promote_s": round(stats["promote_s"], 4)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
