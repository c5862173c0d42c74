"""The fault suite: what survives a lost worker, host, link, index, client, a flood of
requests, broken transfers and garbage, on two hosts (tests/two_hosts.py) and one.

One JSON line per scenario, each with ``scenario``, ``requests``, ``failed`` and ``wrong``
(an output unlike the no-fault reference's, an in-process engine on the same prompts: greedy,
so there must be none), ``suite_s`` (the suite's seconds so far) and the scenario's figures:

- ``pull_1gbit``, ``pull_10gbit``: smollm2-135m, a long prompt computed on one host's worker
  and pulled across the shaped link by the other's (round robin), three times: bandwidth
  against the rate, TTFT pulled against computed and a local hit (medians; ``shares`` lists
  each pull's share of the rate).
- ``slow_link``: kv_aware (tiny-random) with the link at 1 Gbit/s, then at 5 Mbit/s, where
  pulling a 1,900-token prefix is slower than computing it: long prompts computed on one
  worker, followers sent to the other pull or compute; the router must stop pulling once it
  has measured the slow pulls (``pulled_second_half`` 0 at 5 Mbit/s).
- ``worker_killed``: a worker replica killed under mixed streaming / non-streaming load;
  seconds until the index no longer lists it.
- ``worker_hung``: a busy worker's engine process stopped (SIGSTOP) under load: its replica
  kills it after two silent health checks, its requests move; seconds until the index drops it.
- ``replica_hung``: a busy worker's Serve replica process stopped (SIGSTOP) under load: its
  calls send no keep-alive, so their requests move after 10 s of silence; the slowest
  request, and when Serve killed the replica (if it did while the load ran).
- ``index_killed``: the index actor killed under load; seconds until every worker rejoined.
- ``index_hung``: the index actor's process stopped (SIGSTOP) for 20 s under a closed loop of
  short requests: the slowest request before, during and after the hang, and whether the
  index, let go, purged any worker for the silence it could not hear.
- ``client_disconnects``: long streams closed by their clients; seconds until the workers
  stopped them, blocks not freed.
- ``soak``: mixed load for ``--soak-s`` with a worker replica or the index killed every
  30 s: leases and pins back to 0, RSS and threads of the surviving processes flat.
- ``host_lost``: host b's processes all killed under load, then host b started again:
  seconds until the cluster serves on both hosts again (``heal_s``).
- ``link_cut``: the link down for ``--cut-s`` under load, then up: seconds from the link's
  return until both hosts serve (``heal_s``); a host b that does not serve within
  ``REJOIN_WITHIN_S`` (Ray declared it dead meanwhile) is started again, as an autoscaler
  would.
- ``serve_plane``: Serve's controller, then its HTTP proxy, then one of two ingress replicas
  killed under a closed loop of HTTP users, then ``kvmesh serve`` stopped by a SIGTERM to
  its whole process group (bench/serve_plane.py): ``refused`` counts the connections refused
  while Serve replaced its proxy; the stop's seconds and the Ray processes it left.
- ``upgrade``: the app deployed again in place with another setting under a closed loop of
  HTTP users, as a RayService args change is applied: Serve's rolling update replaces every
  replica (bench/upgrade.py).
- ``transfer_faults``, ``overload``, ``fuzz``, ``serve_plane``, ``upgrade``: single-host
  scenarios of their own benches.
  ``transfer_faults`` and ``fuzz``, whose figures are counts (and the soak's are counts and
  memory), run beside the soak and the host faults (``host_lost``, ``link_cut``: counts, and
  heal times with no target), at once, each on a Ray of its own (``beside``: one after the
  other beside the soak alone, they outlasted it by six minutes); the rows whose figures are
  times with a target run alone.

    sudo .venv/bin/python bench/chaos.py [--only pull_1gbit,worker_killed] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from chaos_common import summary  # noqa: E402

from tests.two_hosts import TwoHosts, kvmesh_serve  # noqa: E402

TWO_HOST = ("pull_1gbit", "pull_10gbit", "slow_link", "worker_killed", "worker_hung",
            "replica_hung", "index_killed", "index_hung", "client_disconnects", "soak", "host_lost",
            "link_cut")  # fmt: skip
# host_lost, link_cut: the fault this long after the load starts, full and --quick (the
# load lasts about 40 s, and 8 s with --quick).
FAULT_AFTER_S = {False: 10.0, True: 2.0}
REJOIN_WITHIN_S = 60.0  # link_cut: host b is restarted if it serves no sooner after the cut
# slow_link: the link's rate in each phase, fast first (the costs learned there carry over).
SLOW_LINK_RATES = ("1gbit", "5mbit")


_SUITE_START = time.monotonic()
_EMITTING = threading.Lock()  # rows come from the soak's side too (``beside``)


def emit(row: dict[str, Any]) -> None:
    """One row, with the suite's seconds so far (``suite_s``): where the suite's time goes."""
    line = json.dumps({**row, "suite_s": round(time.monotonic() - _SUITE_START)})
    with _EMITTING:
        print(line, flush=True)


@contextmanager
def beside(works: Sequence[Callable[[], None]]) -> Iterator[None]:
    """Run each of ``works`` on a thread of its own for the duration; wait for them at the
    end, and raise the first error one raised."""
    raised: list[BaseException] = []

    def run(work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:
            raised.append(e)

    threads = [threading.Thread(target=run, args=(w,), name="chaos-beside") for w in works]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for thread in threads:
            thread.join()
    if raised:
        raise raised[0]


def driver(hosts: TwoHosts, scenario: str, model: str, timeout: float = 900, **kw: Any) -> dict:
    args = [scenario, json.dumps(kw)]
    env = {"KVMESH_CLIENT_MODEL": model}
    proc = hosts.popen(
        [sys.executable, "-m", "bench.chaos_driver", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode:
        Path(f"/tmp/kvmesh-chaos-{scenario}.err").write_text(err)  # the whole traceback
        return {"scenario": scenario, "error": err.strip().splitlines()[-1:]}
    return json.loads(out.strip().splitlines()[-1])


def host_fault(
    hosts: TwoHosts, name: str, url: str, n: int, tokens: int, cut_s: float, after_s: float
) -> dict:
    """Load from host a while host b dies (``host_lost``) or its link is cut for ``cut_s``
    (``link_cut``), ``after_s`` into the load; then host b is started again and the time
    until both hosts serve."""
    # Fresh prompts per scenario: a worker holding them all would draw every request.
    kw = {"n": n, "max_tokens": tokens, "salt": TWO_HOST.index(name)}
    ref = driver(hosts, "reference", "tiny-random", **kw)
    kw["base_url"] = url
    proc = hosts.popen(
        [sys.executable, "-m", "bench.chaos_driver", "traffic", json.dumps(kw)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # {"started": ...}
    time.sleep(after_s)
    if name == "host_lost":
        hosts.kill_host("b")
    else:
        hosts.link(False)
        time.sleep(cut_s)
        hosts.link(True)
    back = time.monotonic()  # the link's return
    out, _ = proc.communicate(timeout=900)
    run = _last_json(out, "results")
    if run is None:  # the whole output kept for a look, the suite goes on
        Path(f"/tmp/kvmesh-chaos-{name}.out").write_text(out)
        return {"scenario": name, "error": f"no results from the load (exit {proc.returncode})"}
    # After a short cut host b may still be in the cluster: heal_s counts from the link's
    # return (not from the load's end: requests that move off a silent host end the load
    # before the link is back). A lost host, or one that does not serve within
    # REJOIN_WITHIN_S of the link's return (Ray declared it dead meanwhile), is started
    # again, as an autoscaler would, and heal_s counts from then.
    restarted = name == "host_lost" or not _serves_on_both(
        hosts, url, back + REJOIN_WITHIN_S - time.monotonic()
    )
    if restarted:
        back = time.monotonic()
        hosts.kill_host("b")
        hosts.start_host("b")
    healed = round(time.monotonic() - back, 1) if _serves_on_both(hosts, url, 300) else None
    # Workers that gave final answers: 2 when host b served through the fault (link_cut),
    # 1 when its requests all moved to host a (host_lost: ``migrations`` counts them).
    answering = len({r["kvmesh"]["worker"] for r in run["results"] if r["ok"]})
    cut = cut_s if name == "link_cut" else None
    return summary(
        name, ref, run, workers_answering=answering, heal_s=healed, restarted=restarted, cut_s=cut
    )


def _last_json(out: str, key: str) -> dict[str, Any] | None:
    """The last line of ``out`` that is a JSON object with ``key``: a process under a fault
    may print other lines too (one run's host_lost load ended with a line that was not one)."""
    for line in reversed(out.splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and key in obj:
            return obj
    return None


def slow_link(hosts: TwoHosts, url: str, quick: bool) -> dict[str, Any]:
    """kv_aware (tiny-random: a 1,900-token prefix is 1 MB of KV, computed in tens of ms)
    with the link at each of ``SLOW_LINK_RATES``: where a pull is slower than computing,
    the router learns it from the pulls' measured time and computes instead."""
    row: dict[str, Any] = {"scenario": "slow_link", "requests": 0, "failed": 0, "wrong": 0}
    kw = {"prefixes": 4 if quick else 8, "followers": 6, "words": 140, "max_tokens": 64}
    for rate in SLOW_LINK_RATES:
        hosts.shape(rate)
        phase = driver(hosts, "slow_link", "tiny-random", base_url=url, **kw)
        for k in ("requests", "failed", "wrong"):
            row[k] += phase.pop(k, 0)
        row[rate] = phase
    hosts.shape(None)
    return row


def _serves_on_both(hosts: TwoHosts, url: str, within_s: float) -> bool:
    """Whether both hosts' workers answer within ``within_s`` (one try at least)."""
    deadline = time.monotonic() + within_s
    while True:
        done = hosts.client("traffic", base_url=url, texts=["a", "b", "c", "d"], max_tokens=2)
        if len({r["kvmesh"]["worker"] for r in done["results"] if r["ok"]}) == 2:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(2)


def two_host_rows(
    only: set[str],
    quick: bool,
    cut_s: float,
    soak_s: float,
    beside_soak: Sequence[Callable[[], None]] = (),
) -> None:
    with TwoHosts(cpus=(1, 1)) as hosts:
        a_only = ["--ingress-resources", json.dumps({"host_a": 1})]
        pulls = [s for s in ("pull_1gbit", "pull_10gbit") if s in only]
        if pulls:
            flags = ["--workers", "2", "--num-cpus-per-worker", "1", "--router", "round_robin",
                     "--kv-cache-memory", "512MiB", *a_only]  # fmt: skip
            model = "smollm2-135m"
            with kvmesh_serve(hosts, flags, model=model, answering=2) as url:
                for s in pulls:
                    rate = s.removeprefix("pull_")
                    hosts.shape(rate)
                    words = 150 if quick else 220  # smollm2: 220 words are about 2,050 tokens
                    emit(driver(hosts, "pull", model, base_url=url,
                                dev=hosts.hosts["a"].dev, rate=rate, words=words))  # fmt: skip
                hosts.shape(None)
        flags = ["--workers", "2", "--num-cpus-per-worker", "1", "--block-size", "16",
                 "--kv-cache-memory", "32MiB", *a_only]  # fmt: skip
        if "slow_link" in only:
            # Two sequences per worker: followers of a prompt queue at its holder for real,
            # so the router weighs moving them (a pull, or computing) against waiting.
            with kvmesh_serve(hosts, [*flags, "--max-num-seqs", "2"]) as url:
                emit(slow_link(hosts, url, quick))
        rest = [s for s in TWO_HOST[3:] if s in only]
        if not rest:
            return
        # 64 requests of 200 tokens: about 40 s of load, all of it in flight when a fault
        # lands a second (or FAULT_AFTER_S) in.
        n, tokens = (16, 100) if quick else (64, 200)
        with kvmesh_serve(hosts, flags) as url:
            for s in ("worker_killed", "worker_hung", "replica_hung", "index_killed"):
                if s in only:
                    emit(driver(hosts, s, "tiny-random", base_url=url, n=n, max_tokens=tokens))
            if "index_hung" in only:
                emit(driver(hosts, "index_hung", "tiny-random", base_url=url,
                            hang_s=5.0 if quick else 20.0, max_tokens=16))  # fmt: skip
            if "client_disconnects" in only:
                emit(driver(hosts, "client_disconnects", "tiny-random", base_url=url,
                            streams=10, max_tokens=2000))  # fmt: skip
            # The rows beside run on through the host faults too: their figures are counts
            # and heal times with no target (the soak's two beside rows outlast it here).
            with beside(beside_soak):
                if "soak" in only:
                    kw = {"seconds": soak_s, "n": n // 2, "max_tokens": tokens,
                          "kill_every_s": 30.0}  # fmt: skip
                    emit(driver(hosts, "soak", "tiny-random", timeout=soak_s + 900,
                                base_url=url, **kw))  # fmt: skip
                for s in ("host_lost", "link_cut"):
                    if s in only:
                        emit(host_fault(hosts, s, url, n, tokens, cut_s, FAULT_AFTER_S[quick]))


# The one-host rows: each bench's own command line (its defaults are the sizes).
ONE_HOST = {
    "transfer_faults": (["bench/transfer_faults.py"], ["--pulls", "200"]),
    "overload": (["bench/overload.py"], ["--duration", "15", "--probe", "10"]),
    "fuzz": (["bench/fuzz.py", "--cluster"], ["--cases", "100"]),
    "serve_plane": (["bench/serve_plane.py"], ["--phase-s", "8"]),
    "upgrade": (["bench/upgrade.py"], ["--phase-s", "20"]),
}
# Those whose figures are counts, not times: they run beside the soak when it runs.
BESIDE_SOAK = ("transfer_faults", "fuzz")


def one_host_rows(scenarios: list[str], quick: bool) -> None:
    for scenario in scenarios:
        command, quick_args = ONE_HOST[scenario]
        args = [sys.executable, *command, *(quick_args if quick else [])]
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800)
        rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not rows:
            emit({"scenario": scenario, "error": f"exit {proc.returncode}",
                  "stderr": proc.stderr[-2000:]})  # fmt: skip
            continue
        emit({**json.loads(rows[-1]), "scenario": scenario})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated scenarios (default: all)")
    p.add_argument("--quick", action="store_true", help="smaller runs, for a smoke test")
    p.add_argument("--cut-s", type=float, default=30.0, help="link_cut: seconds down")
    p.add_argument("--soak-s", type=float, default=600.0, help="soak: seconds of load")
    args = p.parse_args()
    only = set(args.only.split(",")) if args.only else {*TWO_HOST, *ONE_HOST}
    unknown = only - {*TWO_HOST, *ONE_HOST}
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    soak_s = min(args.soak_s, 60.0) if args.quick else args.soak_s
    one_host = [s for s in ONE_HOST if s in only]
    beside_soak = [s for s in BESIDE_SOAK if s in one_host] if "soak" in only else []
    two_host_rows(
        only,
        args.quick,
        args.cut_s,
        soak_s,
        [lambda s=s: one_host_rows([s], args.quick) for s in beside_soak],
    )
    one_host_rows([s for s in one_host if s not in beside_soak], args.quick)


if __name__ == "__main__":
    main()
