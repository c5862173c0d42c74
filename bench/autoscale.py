"""How fast the worker deployment autoscales: a load that needs two workers starts on one, and
stops again. Reported per round: seconds from the load's start until Serve runs the second
worker replica, and from its end until one is left. kvmesh's autoscaling settings (how often
each handle reports its load to Serve's controller, and the window it is averaged over) run
beside the ones it had before (``BEFORE``: Serve's 10-s report interval, a 15-s window), in
one run. One JSON line.

tiny-random, workers=1 up to max_workers=2, target_ongoing_requests=1, downscale_delay_s=2
(Serve waits that long below the target), 4 closed-loop threads of 200-token requests.

    .venv/bin/python bench/autoscale.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from kvmesh.cluster import serve_app
from kvmesh.cluster.config import ServeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests/
from tests.ports import free_port
from tests.serve_helpers import running_replicas

LIMIT_S = 120.0
BEFORE = {"METRICS_INTERVAL_S": 10.0, "LOOK_BACK_S": 15.0}


def wait_replicas(n: int) -> float:
    start = time.monotonic()
    while running_replicas() != n:
        if time.monotonic() - start > LIMIT_S:
            raise TimeoutError(f"not {n} worker replicas within {LIMIT_S} s")
        time.sleep(0.2)
    return time.monotonic() - start


def one_round(handle: Any, threads: int) -> tuple[float, float]:
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
            handle.generate.remote(body).result()

    pool = [threading.Thread(target=load, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    try:
        up = wait_replicas(2)
    finally:
        stop.set()
        for t in pool:
            t.join(timeout=60)
    return up, wait_replicas(1)


def run(settings: dict[str, float], rounds: int, port: int) -> dict[str, Any]:
    saved = {name: getattr(serve_app, name) for name in settings}
    for name, value in settings.items():
        setattr(serve_app, name, value)  # read where the deployment's options are built
    try:
        config = ServeConfig(
            model="tiny-random", block_size=4, kv_cache_memory="8MiB", num_cpus_per_worker=0.5,
            port=port, workers=1, max_workers=2, target_ongoing_requests=1.0,
            downscale_delay_s=2.0,
        )  # fmt: skip
        handle = serve_app.deploy(config)
        try:
            handle.generate.remote({"prompt": [1, 2, 3], "max_tokens": 1}).result()
            ups, downs = zip(*(one_round(handle, threads=4) for _ in range(rounds)), strict=True)
        finally:
            serve.delete(serve_app.APP_NAME)
    finally:
        for name, value in saved.items():
            setattr(serve_app, name, value)
    return {
        "metrics_interval_s": settings.get("METRICS_INTERVAL_S", serve_app.METRICS_INTERVAL_S),
        "look_back_s": settings.get("LOOK_BACK_S", serve_app.LOOK_BACK_S),
        "up_s": [round(x, 1) for x in ups],
        "down_s": [round(x, 1) for x in downs],
        "up_median_s": round(statistics.median(ups), 1),
        "down_median_s": round(statistics.median(downs), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        rows = {
            "kvmesh": run({}, args.rounds, port),
            "before": run(BEFORE, args.rounds, port),
        }
    finally:
        ray.shutdown()  # Serve's actors with it
    print(json.dumps({"bench": "autoscale", "rounds": args.rounds, **rows}))


if __name__ == "__main__":
    main()
