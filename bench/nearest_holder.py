"""Does a pull come from the nearest holder? Two hosts (tests/two_hosts.py: network
namespaces, a Ray node each, UCX over TCP, the link between them shaped to ``--rate``), three
worker actors (real Ray, NIXL): ``w-a1`` and ``w-a2`` on host a, ``w-b1`` on host b.

``w-a1`` computes two long prompts and ``w-b1`` pulls both across the link, so both hosts hold
them. Then ``w-a2``, holding neither:

- ``nearest``: asks for the first with no plan (as under round_robin: it looks the index up
  itself and picks by ``nearest_holder``);
- ``across``: asks for the second with a plan naming ``w-b1``: the pull the rule before this
  one made (equal holders by name: ``w-b1`` sorts after ``w-a1``);
- ``computed``: asks for a third prompt no worker holds.

One JSON line: per case the TTFT, the holder read from (``read_from``), the pulled tokens and
the bytes that crossed the link meanwhile; ``across_over_nearest``, the TTFT ratio; outputs
checked equal to ``w-a1``'s. Needs root (namespaces), like bench/chaos.py.

    .venv/bin/python bench/nearest_holder.py [--rate 1gbit] [--words 273]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # the repository, for tests/

from tests.two_hosts import TwoHosts, rate_bits  # noqa: E402
from tests.two_hosts_client import link_bytes, prompt  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rate", default="1gbit", help="the link's rate (tc units)")
    ap.add_argument("--words", type=int, default=273, help="smollm2: 273 words ~ 2,050 tokens")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--inside", default=None, help=argparse.SUPPRESS)  # host a's driver
    return ap.parse_args()


def drive(args: argparse.Namespace, dev: str) -> dict[str, Any]:
    """Runs on host a, joined to the cluster."""
    import ray

    from kvmesh import SamplingParams
    from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
    from kvmesh.workers.engine_config import EngineConfig
    from kvmesh.workers.kv_connector import PullPlan
    from kvmesh.workers.worker_actor import worker_actor_class

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    cfg = EngineConfig(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        progress=False,
    )
    conn = ClusterConnectorConfig(transport="nixl", timeout_s=30.0, lease_s=30.0)
    cls = worker_actor_class(num_gpus=0, num_cpus=1)
    workers = {
        name: cls.options(resources={f"host_{name[2]}": 1}).remote(name, cfg, conn, num_threads=1)
        for name in ("w-a1", "w-a2", "w-b1")
    }
    ray.get([w.ready.remote() for w in workers.values()])
    a1, a2, b1 = workers["w-a1"], workers["w-a2"], workers["w-b1"]
    one = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    texts = [prompt(args.words, salt=salt) for salt in (101, 102, 103)]
    firsts = [ray.get(a1.generate.remote(t, one)) for t in texts[:2]]
    ray.get(a1.flush_events.remote())
    for t in texts[:2]:  # b1 pulls them across the link: both hosts hold them
        out = ray.get(b1.generate.remote(t, one))
        assert out.metrics.num_pulled_tokens > 0, "b1 did not pull"
    ray.get(b1.flush_events.remote())
    depth = (len(firsts[1].prompt_token_ids) - 1) // cfg.block_size

    def case(text: str, plan: PullPlan | None, want: list[int] | None) -> dict[str, Any]:
        before = link_bytes(dev)
        out = ray.get(a2.generate.remote(text, one, pull_plan=plan))
        m = out.metrics
        return {
            "ttft_s": round(m.ttft_s or 0.0, 3),
            "read_from": m.read_from,
            "pulled_tokens": m.num_pulled_tokens,
            "computed_tokens": m.num_computed_tokens,
            "read_s": round(m.read_s, 3),
            "link_mb": round((link_bytes(dev) - before) / 1e6, 1),
            "equal": want is None or out.token_ids == want,
        }

    nearest = case(texts[0], None, firsts[0].token_ids)
    across = case(texts[1], PullPlan("w-b1", depth), firsts[1].token_ids)
    computed = case(texts[2], None, None)
    ray.shutdown()
    return {
        "bench": "nearest_holder",
        "model": args.model,
        "rate": args.rate,
        "prompt_tokens": len(firsts[0].prompt_token_ids),
        "nearest": nearest,
        "across": across,
        "computed": computed,
        "across_over_nearest": round(across["ttft_s"] / nearest["ttft_s"], 2),
        "link_gbit_s": rate_bits(args.rate) / 1e9,
    }


def main() -> int:
    args = parse_args()
    if args.inside is not None:
        print(json.dumps(drive(args, args.inside)))
        return 0
    with TwoHosts(cpus=(2, 1), rate=args.rate) as hosts:
        dev = hosts.hosts["a"].dev
        result = hosts.run_python(
            "bench.nearest_holder", *sys.argv[1:], "--inside", dev, timeout=900
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
