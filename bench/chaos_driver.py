"""The scenarios of bench/chaos.py that run inside host a of the two-host harness.

``python -m bench.chaos_driver SCENARIO JSON`` (cwd: the repository, environment from
``TwoHosts.env``) runs one scenario against the `kvmesh serve` that chaos.py started and
prints its figures as one JSON line. Requests go over HTTP with the official client
(tests/two_hosts_client.py); faults inside Ray (a worker replica, the index actor) are
injected from here through a Ray driver joined to the cluster; faults of a whole host or of
the link are chaos.py's, timed by the ``{"started": ...}`` line ``traffic`` prints first.

The no-fault reference each scenario's outputs are checked against is computed here, by an
in-process engine on the same model (greedy: a served output differs from it only if the
fault changed it): seconds, where a fault-free run through the cluster took a minute.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from bench.chaos_common import (
    index_actor,
    reference,
    run_traffic,
    stats,
    summary,
    texts,
    wait_until,
    whole_cluster,
)
from bench.chaos_index import index_hung, index_killed
from bench.chaos_slow_link import slow_link
from kvmesh.cluster.serve_app import APP_NAME
from tests.serve_helpers import kill_worker, process_alive, replica_actor
from tests.two_hosts import rate_bits
from tests.two_hosts_client import MODEL, complete, link_bytes, prompt, traffic

SOAK_SALT = 100  # the soak's rounds: salts from here on (the others' are below 10)


def pull(base_url: str, dev: str, rate: str, words: int, repeat: int = 3) -> dict[str, Any]:
    """``repeat`` times: a long prompt computed on one worker, then pulled across the link by
    the other (round robin), then a local hit on the first; bandwidth from the connector's own
    transfer time. The figures are the pulls' medians (one pull of ~0.1 s on a shared two-core
    machine is one draw of its load), with each pull's share of the rate listed."""
    rate_bps = rate_bits(rate)
    samples, failed, wrong = [], 0, 0
    for i in range(repeat):
        text = prompt(words, salt=(int(time.time()) + i) % 100000)
        first = complete(base_url, text, 1)
        before, bytes_before = stats(), link_bytes(dev)
        second = complete(base_url, text, 1)
        after = stats()
        hit = complete(base_url, text, 1)  # round robin: back on the first worker, a local hit
        answers = (first, second, hit)
        failed += sum(not r["ok"] for r in answers)
        ok = all(r["ok"] for r in answers)
        wrong += int(ok and not first["text"] == second["text"] == hit["text"])
        kv = [r.get("kvmesh") or {} for r in answers]
        pulled_bytes = after["pull_bytes"] - before["pull_bytes"]
        pull_s = after["pull_s"] - before["pull_s"]
        samples.append({
            "prompt_tokens": kv[0].get("computed_tokens"),
            "pulled_tokens": kv[1].get("pulled_tokens"),
            "pulled_mb": round(pulled_bytes / 1e6, 1),
            "link_mb": round((link_bytes(dev) - bytes_before) / 1e6, 1),
            "pull_s": round(pull_s, 3),
            "share_of_rate": round(pulled_bytes * 8 / pull_s / rate_bps, 3) if pull_s else None,
            "ttft_computed_ms": kv[0].get("ttft_ms"),
            "ttft_pulled_ms": kv[1].get("ttft_ms"),
            "ttft_local_hit_ms": kv[2].get("ttft_ms"),
        })  # fmt: skip

    def median(key: str) -> Any:
        values = sorted(v for x in samples if (v := x[key]) is not None)
        return values[len(values) // 2] if values else None

    share = median("share_of_rate")
    return {
        "scenario": f"pull_{rate}",
        "requests": 3 * repeat,
        "failed": failed,
        "wrong": wrong,
        **{k: median(k) for k in samples[0] if k != "share_of_rate"},
        "gbps": round(share * rate_bps / 1e9, 3) if share is not None else None,
        "share_of_rate": share,
        "shares": [x["share_of_rate"] for x in samples],
    }


def worker_killed(base_url: str, n: int, max_tokens: int) -> dict[str, Any]:
    ref = reference(n, max_tokens, salt=1)
    killed: dict[str, Any] = {}

    def fault() -> None:
        busy = _busy_worker() or next(iter(stats()["workers"]))  # none busy: any
        killed["worker"] = busy
        killed["at"] = time.monotonic()
        kill_worker(busy)
        while killed["worker"] in stats().get("workers", {}):
            time.sleep(0.05)
        killed["purged_s"] = round(time.monotonic() - killed["at"], 2)

    run = run_traffic(base_url, n, max_tokens, salt=1, fault=fault)
    wait_until(lambda: "purged_s" in killed, 60)
    return summary("worker_killed", ref, run, index_purged_s=killed.get("purged_s"))


def worker_hung(base_url: str, n: int, max_tokens: int) -> dict[str, Any]:
    """A busy worker's engine process stopped (SIGSTOP; a wedged device answers nothing
    either) under load: its replica must kill it after two silent health checks, so its
    requests move, and the index must drop it. ``killed_by_replica`` says the replica did
    (else the bench kills the stopped process itself afterwards)."""
    ref = reference(n, max_tokens, salt=4)
    hung: dict[str, Any] = {}

    def fault() -> None:
        busy = _busy_worker() or next(iter(stats()["workers"]))  # none busy: any
        engines = {w: m["handle"] for w, m in ray.get(index_actor().workers.remote()).items()}
        pid = ray.get(engines[busy].__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        at = time.monotonic()
        hung.update(worker=busy, pid=pid)
        # (stats() stops listing a worker that does not answer within 2 s: ask the index.)
        while time.monotonic() - at < 120 and ("killed_s" not in hung or "purged_s" not in hung):
            if "killed_s" not in hung and not process_alive(pid):
                hung["killed_s"] = round(time.monotonic() - at, 2)
            if "purged_s" not in hung and busy not in ray.get(index_actor().workers.remote()):
                hung["purged_s"] = round(time.monotonic() - at, 2)
            time.sleep(0.1)
        hung["done"] = True

    run = run_traffic(base_url, n, max_tokens, salt=4, fault=fault)
    wait_until(lambda: "done" in hung, 150)
    gone = not process_alive(hung["pid"])
    if not gone:
        os.kill(hung["pid"], signal.SIGKILL)
    return summary("worker_hung", ref, run, engine_killed_s=hung.get("killed_s"),
                   index_purged_s=hung.get("purged_s"), killed_by_replica=gone)  # fmt: skip


def replica_hung(base_url: str, n: int, max_tokens: int) -> dict[str, Any]:
    """A busy worker's Serve replica process stopped (SIGSTOP; a process swapped out or
    cut off answers nothing either) under load: its calls send no keep-alive, so the ingress
    moves their requests after five health-check periods of silence (10 s), long before
    Serve gives up on the replica. ``slowest_s``: the slowest request; ``serve_killed_s``:
    when Serve killed the stopped replica (the bench kills it after the load otherwise)."""
    ref = reference(n, max_tokens, salt=6)
    hung: dict[str, Any] = {}

    def fault() -> None:
        busy = _busy_worker() or next(iter(stats()["workers"]))
        replica = replica_actor(busy)
        pid = ray.get(replica.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        at = time.monotonic()
        hung.update(worker=busy, pid=pid)
        while time.monotonic() - at < 120 and process_alive(pid) and "stop" not in hung:
            time.sleep(0.2)
        if not process_alive(pid):
            hung["killed_s"] = round(time.monotonic() - at, 2)
        hung["done"] = True

    run = run_traffic(base_url, n, max_tokens, salt=6, fault=fault)
    hung["stop"] = True  # the load is over: no need to wait for Serve
    wait_until(lambda: "done" in hung, 10)
    if process_alive(hung["pid"]):
        os.kill(hung["pid"], signal.SIGKILL)
    slowest = max((r["seconds"] for r in run["results"] if r["ok"]), default=None)
    return summary("replica_hung", ref, run, slowest_s=round(slowest, 2) if slowest else None,
                   serve_killed_s=hung.get("killed_s"))  # fmt: skip


def _busy_worker(within_s: float = 30.0, besides: str | None = None) -> str | None:
    """A worker running requests now, other than ``besides`` (on a loaded box the load may
    take a while to arrive); None if there is none within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        busy = [w for w, ld in stats()["workers"].items() if ld["running"] and w != besides]
        if busy or time.monotonic() > deadline:
            return busy[0] if busy else None
        time.sleep(0.1)


def client_disconnects(base_url: str, streams: int, max_tokens: int) -> dict[str, Any]:
    """``streams`` long streams, each closed by its client after a few chunks: the workers
    must stop them and free their blocks."""
    import openai

    free_before = {w: ld["free_blocks"] for w, ld in stats()["workers"].items()}
    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    opened = []
    for i in range(streams):
        s = c.completions.create(
            model=MODEL, prompt=prompt(3, salt=9000 + i), max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(s))
        opened.append(s)
    for s in opened:
        s.close()
    closed = time.monotonic()
    wait_until(lambda: all(ld["running"] == 0 for ld in stats()["workers"].values()), 60)
    stopped_s = time.monotonic() - closed
    occupancy = stats()["workers"]
    return {
        "scenario": "client_disconnects",
        "requests": streams,
        "failed": 0,
        "wrong": 0,
        "stopped_s": round(stopped_s, 2),
        "blocks_not_freed": sum(max(0, free_before[w] - ld["free_blocks"])
                                for w, ld in occupancy.items() if w in free_before),
    }  # fmt: skip


def _processes() -> dict[str, Any]:
    """Worker name -> its engine actor's handle, plus the ingress replica's, from the index
    and Ray's named actors."""
    handles = {w: m["handle"] for w, m in ray.get(index_actor().workers.remote()).items()}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#KvmeshServer#"):
            handles["ingress"] = ray.get_actor(a["name"], namespace=a["namespace"])
    return handles


def _footprint(handle: Any) -> dict[str, float]:
    """RSS (MB) and threads of an actor's process, measured inside it."""

    def measure(_self: Any) -> dict[str, float]:
        import psutil

        proc = psutil.Process()
        return {"rss_mb": proc.memory_info().rss / 1e6, "threads": proc.num_threads()}

    return ray.get(handle.__ray_call__.remote(measure), timeout=30)


def soak(base_url: str, seconds: float, n: int, max_tokens: int, kill_every_s: float) -> dict:
    """Mixed load for ``seconds`` with a fault every ``kill_every_s`` (a worker replica or the
    index, in turn; the first worker is never killed so its process can be compared): no
    request lost, leases and pins back to 0, RSS and threads of the survivors flat.

    Each round's prompts are new (a round of prompts the pools already hold would all go to
    their holder, so a killed worker would have nothing running: the thirty-second session's
    soak migrated nothing), and a worker is killed once it runs requests (``busy_kills``)."""
    salts = iter(range(SOAK_SALT, SOAK_SALT + 10**6))
    run_traffic(base_url, n, max_tokens, salt=next(salts))  # warm the processes
    survivor = sorted(w for w in _processes() if w != "ingress")[0]
    watched = {k: h for k, h in _processes().items() if k in (survivor, "ingress")}
    before = {k: _footprint(h) for k, h in watched.items()}
    runs, faults, busy_kills, refs = [], 0, [], []
    computing = ThreadPoolExecutor(1)
    start = time.monotonic()
    end = start + seconds
    next_fault = start + kill_every_s

    def kill_a_busy_victim() -> None:
        victim = _busy_worker(within_s=10.0, besides=survivor)
        if victim is not None:
            kill_worker(victim)
        busy_kills.append(victim is not None)

    while time.monotonic() < end:
        fault = None
        if time.monotonic() >= next_fault:
            faults += 1
            next_fault += kill_every_s
            if faults % 2:
                fault = kill_a_busy_victim
            else:
                fault = lambda: ray.kill(index_actor(), no_restart=False)  # noqa: E731
        salt = next(salts)
        runs.append(run_traffic(base_url, n, max_tokens, salt=salt, fault=fault))
        # The round's no-fault outputs, computed while the next round runs (at the end they
        # would add a minute to the suite).
        refs.append(computing.submit(reference, n, max_tokens, salt))
    whole_cluster()
    time.sleep(5.0)  # leases of the last pulls end; stats settle
    after = {k: _footprint(h) for k, h in watched.items()}
    workers = _processes()
    ref = {"results": [r for f in refs for r in f.result()["results"]]}
    computing.shutdown()
    merged = {"results": [r for run in runs for r in run["results"]], "seconds": end - start}
    return summary(
        "soak", ref, merged,
        faults=faults,
        busy_kills=f"{sum(busy_kills)} of {len(busy_kills)}",
        leases=sum(ray.get(h.num_leases.remote()) for k, h in workers.items() if k != "ingress"),
        pins=sum(ray.get(h.num_pinned.remote()) for k, h in workers.items() if k != "ingress"),
        rss_growth={k: round(after[k]["rss_mb"] / before[k]["rss_mb"] - 1, 3) for k in before},
        threads={k: [before[k]["threads"], after[k]["threads"]] for k in before},
    )  # fmt: skip


def traffic_only(base_url: str, n: int, max_tokens: int, salt: int) -> dict[str, Any]:
    """Load for a fault chaos.py injects (a host, the link): prints a start line first."""
    print(json.dumps({"started": time.time()}), flush=True)
    return traffic(base_url, texts(n, salt), max_tokens, concurrency=n)


SCENARIOS = {
    "pull": pull,
    "slow_link": slow_link,
    "worker_killed": worker_killed,
    "worker_hung": worker_hung,
    "replica_hung": replica_hung,
    "index_killed": index_killed,
    "index_hung": index_hung,
    "client_disconnects": client_disconnects,
    "traffic": traffic_only,
    "reference": reference,
    "soak": soak,
}

if __name__ == "__main__":
    ray.init(log_to_driver=False)  # RAY_ADDRESS: the harness's head
    print(json.dumps(SCENARIOS[sys.argv[1]](**json.loads(sys.argv[2]))), flush=True)
