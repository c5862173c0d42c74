"""`kvmesh serve` as a user runs it: a process that starts its own Ray, serves, and on
SIGTERM or SIGHUP (its terminal closed) shuts down leaving no Ray process behind."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import trustme
from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview

from kvmesh.cluster.deploy_status import RETRYING, refused_start
from kvmesh.cluster.launch import TOKEN_ENV, TOKEN_PATH_ENV, auth_token_available
from kvmesh.cluster.serve_app import PROXY_HEALTH_CHECK_PERIOD_S
from kvmesh.cluster.stop_signals import SIGNALS
from tests.ports import free_port

pytestmark = pytest.mark.slow


def wait_healthy(
    port: int, proc: subprocess.Popen, timeout_s: float = 240, tls: ssl.SSLContext | None = None
) -> None:
    """Until /health answers ok (over HTTPS trusting ``tls``'s CA, when given)."""
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvmesh serve exited early: {proc.stdout.read()}"
        try:
            with urllib.request.urlopen(url, timeout=2, context=tls) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(1)
    raise AssertionError("kvmesh serve never became healthy")


def serve_cmd(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cluster", "serve", "--model", "tiny-random",
            "--workers", "1", "--port", str(port), *flags]  # fmt: skip


ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def start(cmd: list[str], **env: str) -> subprocess.Popen:
    """In a session of its own, as a shell starts a command: its process group is its own,
    and a terminal's or a service manager's signal to that group reaches only it and what
    it started (``os.killpg(proc.pid, ...)``). ``env``: variables added to ours."""
    return subprocess.Popen(
        cmd, env={**ENV, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def test_serve_answers_then_shuts_down_cleanly(tmp_path: Path) -> None:
    """As an operator runs it: over HTTPS (``--ssl-certfile``, ``--ssl-keyfile``), its API key
    from the environment. Stopped by SIGHUP and SIGTERM to its whole process group, as a
    closed terminal, ``kill -TERM -PGID`` or ``timeout`` send them (before: the process died
    at once, without its teardown; then, the local Ray's GCS and raylet died of the same
    signal, and the teardown hung until Ray ended the process after 60 s without its GCS),
    then a burst of stop signals to it alone, which must not hang it or cut its teardown."""
    port = free_port()
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(tmp_path / "key.pem")
    server.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    tls = ssl.create_default_context()
    ca.configure_trust(tls)
    flags = ["--address", "local", "--block-size", "4", "--kv-cache-memory", "8MiB",
             "--ssl-certfile", str(tmp_path / "cert.pem"),
             "--ssl-keyfile", str(tmp_path / "key.pem")]  # fmt: skip
    # The key from the environment (KVMESH_API_KEY), so no command line shows it in `ps`.
    proc = start(serve_cmd(port, *flags), KVMESH_API_KEY="sekret")
    try:
        wait_healthy(port, proc, tls=tls)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in descendants if p.is_running())
        shown = [cmdline(p) for p in [psutil.Process(proc.pid), *descendants] if p.is_running()]
        assert not [c for c in shown if "sekret" in c], shown
        base = f"https://127.0.0.1:{port}/v1"

        def api(key: str, **kw: Any) -> openai.OpenAI:
            http = openai.DefaultHttpxClient(verify=tls)
            return openai.OpenAI(base_url=base, api_key=key, http_client=http, **kw)

        client = api("sekret")
        chat = client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            api("wrong").models.list()
        # Plain HTTP is not served on the port, and a client that does not trust the
        # certificate's CA does not connect.
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
        untrusting = openai.OpenAI(base_url=base, api_key="sekret", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            untrusting.models.list()
        # Serve's HTTP proxy killed: Serve replaces it once its health check has failed 3
        # times; kvmesh starts Serve checking every PROXY_HEALTH_CHECK_PERIOD_S, not Serve's
        # 10 s (connections refused for ~27 s here before, ~7 s now).
        proxy = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "ray::ProxyActor" in cmdline(p)]  # fmt: skip
        assert len(proxy) == 1, [cmdline(p) for p in descendants]
        proxy[0].kill()
        killed = time.monotonic()
        proxy[0].wait(10)
        wait_healthy(port, proc, timeout_s=60, tls=tls)
        assert time.monotonic() - killed < 5 * float(PROXY_HEALTH_CHECK_PERIOD_S) + 5
        descendants = psutil.Process(proc.pid).children(recursive=True)
        # Up (the ingress answers /health a moment before the command says so): what is
        # drained now is a running app's, not one still coming up.
        while "kvmesh: serving" not in (line := proc.stdout.readline()):
            assert line, "kvmesh serve exited before it said it serves"
        assert f"on https://127.0.0.1:{port}/v1" in line, line
        # Serve's controller killed: Ray restarts it. Requests never wait on it (each
        # ingress replica asks it for the app's status once a second, to drain when the app
        # is deleted: an unanswered ask is no deletion), and the stop below drains in order
        # through the new one. (The stop after it hung 1 in 7 times, and once in CI, before
        # StopSignals woke its wait from any thread.)
        controllers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "ray::ServeController" in cmdline(p)]  # fmt: skip
        assert len(controllers) == 1, [cmdline(p) for p in descendants]
        controllers[0].kill()
        controllers[0].wait(10)
        strict = api("sekret", max_retries=0, timeout=10)
        deadline = time.monotonic() + 30
        while True:  # the first at once, while Ray has not restarted it yet
            chat = strict.chat.completions.create(
                model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert chat.usage.completion_tokens >= 1
            if [p for p in psutil.Process(proc.pid).children(recursive=True)
                    if "ray::ServeController" in cmdline(p)]:  # fmt: skip
                break
            assert time.monotonic() < deadline, "Ray did not restart Serve's controller"
        descendants = psutil.Process(proc.pid).children(recursive=True)
    finally:
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGHUP)
        os.killpg(proc.pid, signal.SIGTERM)
        # More stop signals at once (an impatient Ctrl-C, a service manager's SIGTERM): one
        # landing in the handler of the one before hung the process for good.
        for _ in range(50):
            for sig in SIGNALS:
                os.kill(proc.pid, sig)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            # How far the teardown got ("shutting down" printed or not) says where it hung.
            raise AssertionError(f"the stop hung; its output: {proc.communicate()[0]}") from None
    assert proc.returncode == 0, out
    assert "shutting down (running requests get up to 30 s" in out
    assert "Failed to connect to GCS" not in out, out
    # Its own Ray's shutdown ends Serve: no serve.shutdown, whose controller's self-kill
    # under infinite retries made the raylet print "Task ... graceful_shutdown failed".
    assert "graceful_shutdown failed" not in out, out
    assert time.monotonic() - sent < 40, out  # the app deleted, Serve and Ray stopped in order
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"left behind: {[p.cmdline()[:2] for p in alive]}"


def test_an_address_where_nothing_answers_fails_at_once() -> None:
    """Ray retries a GCS that does not answer for minutes; an explicit address is checked
    first (before: 150 s of retry logs, and no exit)."""
    started = time.monotonic()
    out = subprocess.run(
        serve_cmd(free_port(), "--address", f"127.0.0.1:{free_port()}"),
        env=ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out
    assert "no Ray cluster answers at 127.0.0.1:" in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - started < 30


def test_a_token_handed_over_any_way_ray_reads_turns_token_auth_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Joining sets token auth when a token is here in any of Ray's three places (before:
    only ``~/.ray/auth_token``, so a token in ``RAY_AUTH_TOKEN_PATH``, as the two-host
    harness hands its hosts, failed the join with InvalidAuthToken)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_PATH_ENV, raising=False)
    assert not auth_token_available()
    monkeypatch.setenv(TOKEN_ENV, "  ")
    assert not auth_token_available()  # blank is no token
    monkeypatch.setenv(TOKEN_ENV, "f00d")
    assert auth_token_available()
    monkeypatch.delenv(TOKEN_ENV)
    token_file = tmp_path / "cluster-token"
    monkeypatch.setenv(TOKEN_PATH_ENV, str(token_file))
    assert not auth_token_available()  # named, but not there
    token_file.write_text("f00d")
    assert auth_token_available()
    monkeypatch.delenv(TOKEN_PATH_ENV)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("f00d")
    assert auth_token_available()


def test_sigterm_stops_a_deployment_that_never_comes_up() -> None:
    """A worker asks for a resource no node has, so the app never comes up; SIGTERM still
    stops it and leaves no Ray process (before: ignored until SIGKILL)."""
    flags = ["--address", "local", "--worker-resources", '{"no_such_node": 1}']
    proc = start(serve_cmd(free_port(), *flags))
    try:
        # Signals sent while ray.init runs are Ray's to handle; wait for Serve's controller:
        # the deployment is then under way (it waits for its replica from then on).
        deadline = time.monotonic() + 180
        while not any("ServeController" in cmdline(p) for p in descendants(proc)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(1)
        time.sleep(3)
        started = descendants(proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "shutting down" in out
    assert "Traceback" not in out
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"left behind: {[p.cmdline()[:2] for p in alive]}"


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def cmdline(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):  # it may end while we look
        return " ".join(p.cmdline())
    return ""


def test_a_worker_that_cannot_start_is_named_with_its_error() -> None:
    """The pool cannot hold the asked context: the worker refuses to start, and the command
    says why in one line (before: a Serve traceback naming only the deployment), without
    Serve's three starts (each loading the model) to the same error."""
    flags = ["--address", "local", "--kv-cache-memory", "64KiB", "--max-model-len", "512"]
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as ray_tmp:  # short: sockets
        out = subprocess.run(
            serve_cmd(free_port(), *flags),
            env={**ENV, "RAY_TMPDIR": ray_tmp},
            capture_output=True,
            text=True,
            timeout=240,
        )
        logs = Path(ray_tmp).glob("ray/session_*/logs/serve/replica_kvmesh_kvmesh-worker_*")
        starts = {log.name for log in logs}  # session_latest links to the session
    assert out.returncode == 1, out.stdout[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvmesh: error: kvmesh-worker failed to start: ValueError: "), last
    assert "max_model_len: 512 tokens do not fit in the KV cache, which holds 128" in last
    assert "Traceback" not in out.stderr
    # One replica log per start: Serve's three before. Serve may begin its second start
    # before the command sees the first one's error, never its third.
    assert len(starts) < 3, starts


def _app(message: str, status: str = "UPDATING") -> ApplicationStatusOverview:
    deployment = DeploymentStatusOverview(
        DeploymentStatus[status], DeploymentStatusTrigger.CONFIG_UPDATE_STARTED, {}, message
    )
    return ApplicationStatusOverview(
        ApplicationStatus.DEPLOYING, "", 0.0, {"kvmesh-worker": deployment}
    )


def test_only_a_refused_setting_stops_the_start_at_once() -> None:
    """``refused_start``: a replica's ValueError (the engine refusing its settings) ends the
    start; any other failure is left to Serve's retries, and so is a deployment still fine."""
    error = "Traceback (most recent call last):\n  ...\n"
    refused = f"{RETRYING} with exception. Retrying 2 more time(s). Error:\n{error}"
    got = refused_start(_app(refused + "ValueError: max_model_len: 512 tokens do not fit"))
    assert got == "kvmesh-worker failed to start: ValueError: max_model_len: 512 tokens do not fit"
    lost = refused + "ray.exceptions.ActorDiedError: The actor died unexpectedly"
    assert refused_start(_app(lost)) is None
    assert refused_start(_app("")) is None
    assert refused_start(_app("Deploying: 0 of 1 replicas running")) is None


def refused_before_ray(port: int, *flags: str, code: int = 1) -> str:
    """Run ``kvmesh serve`` on a local Ray, expecting a refusal before that Ray starts (no
    Ray session, exit ``code``, no traceback); its last line."""
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as tmp:
        out = subprocess.run(
            serve_cmd(port, "--address", "local", *flags), env={**ENV, "RAY_TMPDIR": tmp},
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        sessions = list(Path(tmp).glob("ray/session_*"))
    assert not sessions, sessions
    assert out.returncode == code, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "actor_id" not in out.stderr, out.stderr[-2000:]
    return out.stderr.strip().splitlines()[-1]


def test_a_model_not_on_this_machine_is_refused_before_ray_starts(tmp_path: Path) -> None:
    """A local Ray's workers load the model here: a missing file or an unknown name is one
    line (exit 2, bad input) before any Ray starts (before: after Ray's and Serve's starts,
    from the ingress replica, some 8 s)."""
    missing = tmp_path / "missing.gguf"
    last = refused_before_ray(free_port(), "--model", str(missing), code=2)
    assert last == f"kvmesh: error: GGUF file {missing} does not exist", last
    last = refused_before_ray(free_port(), "--model", "no-such-model", code=2)
    assert last.startswith("kvmesh: error: unknown model 'no-such-model': use one of"), last


def test_a_host_not_of_this_machine_is_named_as_the_host() -> None:
    """An address this machine does not have (198.18.0.0/15, never routed; binding sends
    nothing): one line names the host, before any Ray starts (before: "port: ... is in use",
    after Ray's and Serve's starts)."""
    port = free_port()
    last = refused_before_ray(port, "--host", "198.18.0.1")
    assert last == f"kvmesh: error: host: cannot listen on 198.18.0.1:{port} here (Cannot " \
        "assign requested address); pass an address of this machine (0.0.0.0: all of them)", \
        last  # fmt: skip


def test_a_port_in_use_is_named_without_a_traceback() -> None:
    """The port is taken: one line says so (before: a traceback of ``ProxyActor.ready`` with
    its pid and actor id), before the command starts a Ray of its own (before: after Ray's
    and Serve's starts, some 15 s, only for Serve's proxy to fail)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        last = refused_before_ray(port)
    assert last == f"kvmesh: error: port: 127.0.0.1:{port} is in use (Serve's HTTP proxy " \
        "could not bind it); pass another --port", last  # fmt: skip
