"""Two hosts (network namespaces, a Ray node each, tests/two_hosts.py): an operator's join,
a pull across the link, a host lost under load and healed.

One `kvmesh serve` for the module, joined to the head as an operator does (``kvmesh_serve``:
an explicit ``--address``, no ``RAY_AUTH_MODE``). Two workers with one CPU each on hosts of
one CPU each: one worker per host. The ingress is held on host a (``--ingress-resources``),
the way an operator keeps it off the workers' machines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.two_hosts import TwoHosts, available, kvmesh_serve, serve_log
from tests.two_hosts_client import prompt
from tests.two_hosts_client import reference as no_fault_outputs

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny-random: layers * (K, V) * heads * dim * f32
FLAGS = [
    "--block-size", "16", "--kv-cache-memory", "16MiB",
    "--workers", "2", "--num-cpus-per-worker", "1", "--router", "round_robin",
    "--ingress-resources", json.dumps({"host_a": 1}),
]  # fmt: skip


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with TwoHosts(cpus=(1, 1)) as h:
        yield h


@pytest.fixture(scope="module")
def base_url(hosts: TwoHosts) -> Iterator[str]:
    with kvmesh_serve(hosts, FLAGS, answering=2) as url:  # round robin over both
        yield url


def test_serve_joins_and_a_pull_crosses_the_link(hosts: TwoHosts, base_url: str) -> None:
    dev = hosts.hosts["a"].dev
    first, second = hosts.client("pull", base_url=base_url, dev=dev, words=80)["requests"]
    assert first["ok"] and second["ok"], (first, second)
    assert first["kvmesh"]["worker"] != second["kvmesh"]["worker"]
    pulled = second["kvmesh"]["pulled_tokens"]
    prompt_tokens = first["kvmesh"]["computed_tokens"]
    assert pulled >= 0.9 * prompt_tokens - 16, (first, second)
    assert second["text"] == first["text"]
    # The KV crossed the veth (not shared memory between the namespaces).
    assert second["link_bytes"] >= pulled * TINY_KV_BYTES_PER_TOKEN, second


def test_a_host_lost_under_load_costs_no_request_and_heals(hosts: TwoHosts, base_url: str) -> None:
    texts = [prompt(40, salt=1000 + i) for i in range(8)]
    kw = {"base_url": base_url, "texts": texts, "max_tokens": 500, "concurrency": 8}
    reference = no_fault_outputs(texts, kw["max_tokens"])["results"]  # in-process, seconds

    run = hosts.popen(
        [sys.executable, "-m", "tests.two_hosts_client", "traffic",
         json.dumps({**kw, "announce": True})],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert run.stdout is not None
    # Every stream has had text: the 8 requests are on both hosts' workers, 500 tokens to go.
    assert json.loads(run.stdout.readline())["streaming"] == 4
    assert hosts.kill_host("b") > 0
    out, _ = run.communicate(timeout=300)
    results = json.loads(out.strip().splitlines()[-1])["results"]
    failed = [r for r in results if not r["ok"]]
    assert not failed, f"{failed}\n{serve_log(hosts)}"
    assert [r["text"] for r in results] == [r["text"] for r in reference]
    # Round robin put half the requests on host b: they moved to host a's worker.
    moved = sum(r["kvmesh"]["migrations"] for r in results)
    assert moved >= 1, [r["kvmesh"] for r in results]

    # Healed: host b is back, Serve starts its worker there and traffic reaches it.
    hosts.start_host("b")
    deadline = time.monotonic() + 180
    while True:
        done = hosts.client("traffic", **{**kw, "texts": texts[:4], "max_tokens": 4})["results"]
        workers = {r["kvmesh"]["worker"] for r in done if r["ok"]}
        if len(workers) == 2 and all(r["ok"] for r in done):
            break
        assert time.monotonic() < deadline, f"not healed: {done}\n{serve_log(hosts)}"
        time.sleep(2.0)
