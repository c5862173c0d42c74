"""Do the streams decoding on a worker stall while a prefix is pulled into it?

Two worker actors (real Ray, NIXL). Worker B decodes 8 streams; meanwhile a new request on B
pulls a 2048-token prefix from worker A. Reported, in one JSON line:

- ``max_gap_over_median``: the streams' longest gap between two tokens that overlaps the pull
  (from the pulled request's arrival to its first token, so the step that computes its suffix
  is in), over the streams' median gap (target <= 1.5). Also reported: the same for the
  request as a local hit (``local_hit_...``: what its suffix's step alone costs the streams),
  for the transfer alone, arrival to the load's end (``transfer_...``: the suffix's step left
  out) and for a window as long before the pull (``control_...``: the box's noise);
- ``ttft_over_bound``: the pulled request's TTFT over (the TTFT of the same request as a local
  hit on B, measured under the same load, + the pulled bytes at the link's rate) (target
  <= 1.2). The link's rate is ``--link-gbps``, or else measured: a pull of another prompt of the
  same length into B while it is idle, before the streams start.

``--shaped RATE`` runs all of it inside a network namespace of its own (``kvm-stall-<pid>``)
whose loopback is shaped with ``tc qdisc ... tbf rate RATE`` and NIXL forced onto TCP
(``UCX_TLS=tcp,self UCX_NET_DEVICES=lo``); the namespace is removed afterwards, also on failure.
Needs root; never touches the root namespace's interfaces. ``--plan`` hands B the router's
plan (holder A, all the prefix's blocks), as the kv_aware router does; without it B looks the
index up itself, as with round_robin.

    cd bench && ../.venv/bin/python pull_stall.py [--shaped 1gbit] [--plan]
        [--kv-cache-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import ray

from kvmesh import SamplingParams
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.worker_actor import worker_actor_class

NUM_STREAMS = 8
CONTROL_S = 2.0  # the streams decode this long with no pull first (the control window)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=240, help="max_tokens of each stream")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--kv-cache-dtype", default="auto", help="e.g. bfloat16: half the bytes")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    ap.add_argument("--link-gbps", type=float, default=None, help="default: measured")
    ap.add_argument("--shaped", default=None, help="e.g. 1gbit: shape loopback in a netns")
    ap.add_argument("--plan", action="store_true", help="send the router's plan with the pull")
    ap.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def run_shaped(args: argparse.Namespace) -> int:
    """Run this script again inside a fresh network namespace with a shaped loopback."""
    ns = f"kvm-stall-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        inside = ["ip", "netns", "exec", ns]
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True)
        shape = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", args.shaped]
        subprocess.run([*inside, *shape, "burst", "512kb", "latency", "200ms"], check=True)
        env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
        argv = [a for a in sys.argv[1:] if a != "--inside-namespace"]
        return subprocess.run(
            [*inside, sys.executable, os.path.abspath(__file__), *argv, "--inside-namespace"],
            env=env,
        ).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


class Stream:
    """One decoding request on B; records when each token reached this process."""

    def __init__(self, worker: Any, prompt: list[int], params: SamplingParams) -> None:
        self.times: list[float] = []
        self.done = threading.Event()
        self._gen = worker.generate_stream.remote(prompt, params)
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for ref in self._gen:
                delta = ray.get(ref)
                # One time per token: tokens that piled up while this thread was busy come
                # merged in one delta (``Worker.stream``), and arrived together.
                self.times.extend([time.perf_counter()] * len(delta.token_ids))
        finally:
            self.done.set()

    def gaps(self, skip: int) -> list[tuple[float, float]]:
        """(start, end) of each gap between two tokens, after the first ``skip`` tokens."""
        t = self.times[skip:]
        return list(itertools.pairwise(t))


def timed_request(worker: Any, prompt: list[int], params: SamplingParams, **kw: Any) -> Any:
    """(submit time, first delta time, output) with the driver's clock."""
    submitted = time.perf_counter()
    first = None
    out = None
    for ref in worker.generate_stream.remote(prompt, params, **kw):
        delta = ray.get(ref)
        first = first or time.perf_counter()
        out = delta.output or out
    return submitted, first, out


def main() -> None:
    args = parse_args()
    if args.shaped and not args.inside_namespace:
        sys.exit(run_shaped(args))
    init: dict[str, Any] = {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False}
    if args.inside_namespace:
        init["_node_ip_address"] = "127.0.0.1"
    ray.init(**init)
    try:
        print(json.dumps(measure(args)))
    finally:
        ray.shutdown()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cfg = EngineConfig(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        progress=False,
    )
    conn = ClusterConnectorConfig(transport="nixl", timeout_s=30.0, lease_s=30.0)
    cls = worker_actor_class(num_gpus=0, num_cpus=1)
    a, b = (cls.remote(f"stall-{n}", cfg, conn, num_threads=args.threads) for n in "ab")
    info_a, info_b = ray.get([a.ready.remote(), b.ready.remote()])
    bs = info_b["block_size"]
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    n_prompt = args.prefix_tokens + args.suffix_tokens
    one = SamplingParams(max_tokens=1, temperature=0)
    ray.get([a.generate.remote([5, 6, 7], one), b.generate.remote([5, 6, 7], one)])
    # The NIXL handshake (once per pair) and the idle link rate: a pull of another prompt of
    # the same length, with B idle.
    calibration = tokens(n_prompt)
    ray.get(a.generate.remote(calibration, one))
    ray.get(a.flush_events.remote())
    base = ray.get(b.connector_stats.remote())
    ray.get(b.generate.remote(calibration, one))
    idle = ray.get(b.connector_stats.remote())
    idle_bytes = idle["pulled_bytes"] - base["pulled_bytes"]
    idle_s = idle["pull_s"] - base["pull_s"]
    link_bps = args.link_gbps * 1e9 / 8 if args.link_gbps else idle_bytes / max(idle_s, 1e-9)

    prompt = tokens(n_prompt)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reference = ray.get(a.generate.remote(prompt, params))
    ray.get(a.flush_events.remote())

    stream_params = SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
    streams = [Stream(b, tokens(32), stream_params) for _ in range(NUM_STREAMS)]
    warm = 20
    while min(len(s.times) for s in streams) < warm:
        time.sleep(0.01)
    time.sleep(CONTROL_S)  # a stretch without a pull, to compare the pull's window against

    kw: dict[str, Any] = {}
    if args.plan:
        from kvmesh.workers.kv_connector import PullPlan

        kw["pull_plan"] = PullPlan(info_a["worker_id"], (n_prompt - 1) // bs)
    before = ray.get(b.connector_stats.remote())
    submitted, first, pulled = timed_request(b, prompt, params, **kw)
    after = ray.get(b.connector_stats.remote())
    time.sleep(0.3)
    local_submitted, local_first, local = timed_request(b, prompt, params)  # a local hit now
    alive = not any(s.done.is_set() for s in streams)
    for s in streams:
        s.done.wait(300)

    all_gaps = [g for s in streams for g in s.gaps(warm)]
    median_gap = statistics.median(e - s for s, e in all_gaps)
    # Every gap that overlaps the pulled request's wait, from its arrival to its first token:
    # a pull on the step thread stalls the step that ends with that token, so the window must
    # hold it (and so it also holds the step that computes the request's suffix, which costs
    # the streams as much as for a local hit: reported apart).
    during = [e - s for s, e in all_gaps if e > submitted and s < first]
    max_gap = max(during, default=0.0)
    # The pull alone, from the arrival to the load's end (the worker's perf_counter is this
    # host's monotonic clock too): a pull on the step thread stalls a step overlapping it,
    # while the suffix's step after it (the request's own compute) is left out.
    m = pulled.metrics
    load_end = first if m.first_scheduled_time is None else m.first_scheduled_time + m.kv_load_s
    load_end = min(load_end, first)
    transfer = [e - s for s, e in all_gaps if e > submitted and s < load_end]
    # The same length of time just before the pull: how long the longest gap is without one
    # (on a shared CPU box, noise alone makes it well over the median).
    control_start = max(submitted - (first - submitted), submitted - CONTROL_S)
    control = [e - s for s, e in all_gaps if s >= control_start and e <= submitted]
    # The same request as a local hit: what joining the batch (its prefill) costs the streams.
    hit = [e - s for s, e in all_gaps if e > local_submitted and s < local_first]
    pulled_bytes = after["pulled_bytes"] - before["pulled_bytes"]
    bound = local.metrics.ttft_s + pulled_bytes / link_bps
    return {
        "bench": "pull_stall",
        "model": args.model,
        "link": f"shaped {args.shaped}" if args.shaped else "loopback",
        "plan": args.plan,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_gap_over_median": round(max_gap / median_gap, 2),
        "ttft_over_bound": round(pulled.metrics.ttft_s / bound, 2),
        "transfer_max_gap_over_median": round(max(transfer, default=0.0) / median_gap, 2),
        "control_max_gap_over_median": round(max(control, default=0.0) / median_gap, 2),
        "local_hit_max_gap_over_median": round(max(hit, default=0.0) / median_gap, 2),
        "median_gap_ms": round(median_gap * 1e3, 1),
        "max_gap_during_pull_ms": round(max_gap * 1e3, 1),
        "gaps_during_pull": len(during),
        "pull_window_ms": round((first - submitted) * 1e3, 1),
        "transfer_window_ms": round((load_end - submitted) * 1e3, 1),
        "gaps_during_transfer": len(transfer),
        "pulled_ttft_s": round(pulled.metrics.ttft_s, 4),
        "local_hit_ttft_s": round(local.metrics.ttft_s, 4),
        "pulled_tokens": pulled.metrics.num_pulled_tokens,
        "pulled_mb": round(pulled_bytes / 1e6, 1),
        "pull_s": round(after["pull_s"] - before["pull_s"], 4),
        "link_gbps": round(link_bps * 8 / 1e9, 2),
        "link_rate_measured": args.link_gbps is None,
        "idle_pull_s": round(idle_s, 4),
        "ttft_bound_s": round(bound, 4),
        "outputs_equal": pulled.token_ids == reference.token_ids,
        "streams_alive_throughout": alive,
        "streams": NUM_STREAMS,
    }


if __name__ == "__main__":
    main()
