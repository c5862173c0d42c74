"""`kvmesh serve` as a user runs it: a process that starts its own Ray, serves, and on
SIGTERM shuts down leaving no Ray process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from tests.ports import free_port

pytestmark = pytest.mark.slow


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvmesh serve exited early: {proc.stdout.read()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(1)
    raise AssertionError("kvmesh serve never became healthy")


def test_serve_answers_then_shuts_down_cleanly() -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.cluster",
        "serve",
        "--address",
        "local",
        "--model",
        "tiny-random",
        "--block-size",
        "4",
        "--kv-cache-memory",
        "8MiB",
        "--workers",
        "1",
        "--port",
        str(port),
        "--api-key",
        "sekret",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_healthy(port, proc)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in descendants if p.is_running())
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key="sekret")
        chat = client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong").models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, out
    assert "shutting down" in out
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"left behind: {[p.cmdline()[:2] for p in alive]}"
