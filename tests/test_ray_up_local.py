"""A real `ray up` / `kvmesh serve` / `ray down` on this one machine.

`ray up` launches a head through the test-only node provider in ``tests/local_provider``; the
head's autoscaler (v2, Ray's default) launches one CPU worker node (min_workers: 1) through the
same provider; `kvmesh serve --address <head>` deploys onto that cluster and answers a chat
request (the head has no CPUs, so the engine worker runs on the autoscaled node); then
`ray down` must leave no process of that cluster behind. The cluster has its own ports and
``--temp-dir``, so a Ray that this pytest session runs is never touched.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.local_provider.harness import VENV_BIN, LocalCluster, clean_env, wait_for


def _post(url: str, body: dict) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_up_serve_ray_down(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)
    serve_log = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{cluster.ports['serve_port']}"
    serve: subprocess.Popen[bytes] | None = None
    phases: list[tuple[str, float]] = [("start", time.monotonic())]
    torn_down = False
    try:
        cluster.ray("up", "-y", "--no-config-cache", str(cluster.config))
        phases.append(("ray up (head)", time.monotonic()))
        wait_for(cluster.worker_up, 240, lambda: f"no worker node came up\n{cluster.logs()}")
        phases.append(("autoscaled worker", time.monotonic()))

        with open(serve_log, "wb") as out:
            serve = subprocess.Popen(
                [str(VENV_BIN / "kvmesh"), "serve", "--address", cluster.gcs_address,
                 "--model", "tiny-random", "--workers", "1", "--num-cpus-per-worker", "1",
                 "--kv-cache-memory", "64MiB", "--port", str(cluster.ports["serve_port"])],
                cwd=tmp_path, env=clean_env(), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(
            lambda: serve.poll() is not None or _healthy(f"{base}/health"),
            240,
            lambda: f"kvmesh serve never became healthy\n{cluster.logs(serve_log)}",
        )
        assert serve.poll() is None, f"kvmesh serve exited\n{cluster.logs(serve_log)}"
        phases.append(("kvmesh serve", time.monotonic()))

        reply = _post(
            f"{base}/v1/chat/completions",
            {
                "model": "tiny-random",
                "messages": [{"role": "user", "content": "Hello, cluster!"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert isinstance(reply["choices"][0]["message"]["content"], str)
        assert reply["usage"]["completion_tokens"] >= 1
        # The head has no CPUs: the one engine worker holds the autoscaled node's CPU.
        status = cluster.ray("status", "--address", cluster.gcs_address, timeout=60)
        active = status.partition("Active:")[2].partition("Idle:")[0].split("\n")
        assert {"1 head", "1 cpu_worker"} <= {line.strip() for line in active}, status
        assert "1.0/1.0 CPU" in status, status
        phases.append(("chat", time.monotonic()))

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0, f"unclean stop\n{cluster.logs(serve_log)}"
        phases.append(("SIGTERM serve", time.monotonic()))

        cluster.ray("down", "-y", str(cluster.config), timeout=180)
        torn_down = True
        assert cluster.store.snapshot()["nodes"] == {}, "ray down left nodes in the provider"
        wait_for(
            lambda: not cluster.survivors(),
            30,
            lambda: "left after ray down:\n" + "\n".join(cluster.survivors()),
        )
        phases.append(("ray down", time.monotonic()))
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
            serve.wait(timeout=30)
        cluster.cleanup(kill=not torn_down)
        print(", ".join(f"{n} {t - p:.0f}s" for (_, p), (n, t) in itertools.pairwise(phases)))
