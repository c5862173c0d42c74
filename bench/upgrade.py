"""The kvmesh app updated in place under load, as an operator rolls out a new setting.

A RayService whose serveConfigV2 args change is applied to the running Serve in place (no new
Ray cluster), and so is ``deploy(config)`` with the app already running: every deployment
whose arguments changed gets a new version, and Serve's rolling update starts new replicas
and drains the old ones (``--drain-timeout-s``). This runs the app (``--model``, 2 workers, 2
ingress replicas) on a local Ray under a closed loop of ``--users`` HTTP users
(serve_plane.py's: one official ``openai`` client each, its connection kept alive, no retries,
greedy, every other request streamed, answers checked against an in-process engine's), and
``--upgrade-after-s`` into it deploys the same app with another ``max_queued_requests``
(which every deployment's arguments carry).

One JSON line: ``scenario`` "upgrade", ``requests``, ``failed`` (sent and not answered
whole), ``wrong`` (unlike the reference), ``refused`` (connections refused), the failures'
``kinds``; ``upgrade_s`` (the in-place deploy, until the new version serves); the replicas
before and after (``replaced``: no replica of the old version left).

    .venv/bin/python bench/upgrade.py [--model tiny-random] [--phase-s 40]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]


def parse_args() -> argparse.Namespace:
    from serve_plane import add_load_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p, phase_s=40.0)
    p.add_argument("--upgrade-after-s", type=float, default=5.0)
    args = p.parse_args()
    args.fault_after_s = args.upgrade_after_s  # serve_plane.load's name for it
    return args


def replicas() -> set[str]:
    """The kvmesh app's Serve replica actors now (ingress and workers)."""
    import ray

    from kvmesh.cluster.serve_app import APP_NAME

    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in named if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#")}


def main() -> None:
    args = parse_args()
    os.environ["KVMESH_CLIENT_MODEL"] = args.model  # the clients' and the reference's model
    import ray
    from chaos_common import texts as chaos_texts
    from serve_plane import load

    from kvmesh.cluster.config import ServeConfig
    from kvmesh.cluster.serve_app import deploy
    from tests.ports import free_port
    from tests.two_hosts_client import reference

    texts = chaos_texts(args.prompts, salt=11)
    ref = reference(texts, args.max_tokens)["results"]
    port = free_port()

    def config(max_queued_requests: int) -> ServeConfig:
        return ServeConfig(
            model=args.model, workers=2, ingress_replicas=2, port=port,
            max_queued_requests=max_queued_requests,
        )  # fmt: skip

    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        deploy(config(64))
        before = replicas()
        upgrade: dict[str, Any] = {}

        def roll_out() -> None:
            started = time.monotonic()
            deploy(config(48))  # in place: a new version of every deployment
            upgrade["s"] = round(time.monotonic() - started, 1)

        row = load(f"http://127.0.0.1:{port}", texts, ref, args, roll_out)
        after = replicas()
    finally:
        ray.shutdown()
    row = {
        "scenario": "upgrade",
        "model": args.model,
        **row,
        "upgrade_s": upgrade.get("s"),
        "replicas_before": len(before),
        "replicas_after": len(after),
        "replaced": not before & after,
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
