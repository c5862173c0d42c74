"""Two hosts on one machine: network namespaces joined by a veth pair, a Ray node in each.

``TwoHosts`` (a context manager; ``two_hosts`` in conftest is its pytest fixture) builds:

- namespaces ``<tag>a`` and ``<tag>b``, a veth pair between them with addresses from
  198.18.0.0/15 (reserved for network benchmarks, never routed), loopback up in each;
- a Ray head (``ray start --head``) in host a and a Ray node joining it (``ray start
  --address``) in host b, each with its own CPUs and a custom resource (``host_a``, ``host_b``)
  so a test can place actors explicitly, under its own Ray temp dir (so the machine's
  ``/tmp/ray/ray_current_cluster`` is never touched);
- the cluster's auth token (Ray 2.60 turns token authentication on), made by the harness and
  handed to every process on its hosts in ``RAY_AUTH_TOKEN_PATH``, as an operator hands a
  cluster's token to its machines. Those processes also get an empty ``HOME``: a token in
  ``~/.ray`` (which any local ``ray.init()`` leaves behind) is never what makes a join work,
  so the harness behaves on a fresh machine as it does after other tests.

It shapes the link (``tc qdisc ... tbf rate R``: netem is not available here), cuts it
(``ip link set ... down``), kills a host (SIGKILL to every process in its namespace) and
starts it again, and counts the bytes that crossed the link. Drivers and clients run inside
host a (``run`` / ``popen``), where the head's address is reachable.

UCX and the link: between namespaces of one machine UCX still finds shared memory and
cross-memory attach (it knows the machine by its boot id), so a pull never touches the veth
(measured: 10 KB on the link for a 1 MB pull). Machines share neither, so the harness starts
each host with ``UCX_TLS=tcp,self``: the bytes cross the veth as they would cross a NIC, which
``test_two_hosts`` checks against the link's byte counters.

Everything it made is removed on exit, also when a test fails; a harness left behind by a
killed test run is removed by the next one (``sweep``). Only its own addresses are contacted.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STATE_DIR = Path("/tmp/kvmesh-hosts")  # one subdirectory per live harness: its owner's pid
RAY_PORT = 6379
UCX_ENV = {"UCX_TLS": "tcp,self"}  # see the module docstring


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a skip message)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


@dataclass(frozen=True)
class Host:
    name: str  # "a" or "b"
    netns: str
    dev: str  # its end of the veth pair
    ip: str
    cpus: float
    temp_dir: str

    @property
    def resource(self) -> str:
        return f"host_{self.name}"


class TwoHosts:
    """See the module docstring. ``cpus`` per host; ``rate`` shapes the link from the start."""

    def __init__(self, cpus: tuple[float, float] = (1, 1), rate: str | None = None) -> None:
        self.tag = "kvm" + secrets.token_hex(3)  # interface names allow 15 characters
        n = secrets.randbelow(1 << 14)  # one /30 of 198.18.0.0/15's /16 halves
        base = f"198.18.{n >> 6}.{(n & 63) * 4}"
        self.dir = STATE_DIR / self.tag
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        self.hosts = {
            name: Host(
                name,
                f"{self.tag}{name}",
                f"{self.tag}{name}0",
                f"{prefix}.{last + i + 1}",
                cpus[i],
                str(self.dir / name),
            )
            for i, name in enumerate("ab")
        }
        self.rate = rate
        self.head = f"{self.hosts['a'].ip}:{RAY_PORT}"
        self.home = self.dir / "home"
        self.token_path = self.dir / "auth_token"

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> TwoHosts:
        sweep()
        self.dir.mkdir(parents=True)
        (self.dir / "owner").write_text(str(os.getpid()))
        self.home.mkdir()
        self.token_path.write_text(secrets.token_hex(32))  # as `ray get-auth-token --generate`
        self.token_path.chmod(0o600)
        try:
            self._make_network()
            if self.rate:
                self.shape(self.rate)
            for name in "ab":
                self.start_host(name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        _remove(self.tag)

    def _make_network(self) -> None:
        a, b = self.hosts["a"], self.hosts["b"]
        for h in (a, b):
            _sh("ip", "netns", "add", h.netns)
        _sh("ip", "link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for h in (a, b):
            _sh("ip", "link", "set", h.dev, "netns", h.netns)
            _sh("ip", "-n", h.netns, "addr", "add", f"{h.ip}/30", "dev", h.dev)
            _sh("ip", "-n", h.netns, "link", "set", "lo", "up")
            _sh("ip", "-n", h.netns, "link", "set", h.dev, "up")

    # -- hosts -----------------------------------------------------------------------------

    def env(self, host: str = "a", extra: dict[str, str | None] | None = None) -> dict[str, str]:
        """The environment of a process on ``host``: its Ray temp dir, token auth and the
        cluster's token, an empty home, UCX, the head's address; ``extra`` adds to it (a None
        value removes the variable)."""
        h = self.hosts[host]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "UCX_"))}
        env.update(UCX_ENV)
        env.update(
            RAY_TMPDIR=h.temp_dir,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.token_path),
            HOME=str(self.home),
            RAY_ADDRESS=self.head,
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONPATH=str(REPO),
        )
        for key, value in (extra or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def start_host(self, name: str) -> None:
        """``ray start`` on the host: the head on a, a node joining it on b."""
        h = self.hosts[name]
        Path(h.temp_dir).mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            f"--node-ip-address={h.ip}",
            f"--num-cpus={h.cpus}",
            f"--resources={json.dumps({h.resource: 100})}",
            "--object-store-memory=150000000",
            "--disable-usage-stats",
        ]
        if name == "a":
            args += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            args += [f"--address={self.head}"]
        env = self.env(name, {"RAY_ADDRESS": None})
        for _ in range(2):
            out = subprocess.run(
                ["ip", "netns", "exec", h.netns, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            if out.returncode == 0:
                return
            # Ray gives a node 60 s to come up; a machine loaded by other jobs can miss that
            # once. Clear what the failed start left and try again.
            _kill_netns(h.netns)
        raise RuntimeError(f"ray start on host {name} failed:\n{out.stdout}\n{out.stderr}")

    def kill_host(self, name: str) -> int:
        """SIGKILL every process of the host (its Ray node and whatever runs there), as a
        machine that lost power; returns how many processes were killed."""
        return _kill_netns(self.hosts[name].netns)

    # -- the link --------------------------------------------------------------------------

    def shape(self, rate: str | None) -> None:
        """Limit the link to ``rate`` (tc's units: "1gbit") both ways; None removes it."""
        for h in self.hosts.values():
            tc = ("ip", "netns", "exec", h.netns, "tc", "qdisc")
            _sh(*tc, "del", "dev", h.dev, "root", check=False)
            if rate:
                limit = ("tbf", "rate", rate, "burst", _burst(rate), "latency", "400ms")
                _sh(*tc, "add", "dev", h.dev, "root", *limit)
        self.rate = rate

    def link(self, up: bool) -> None:
        """Cut the link (both ends down) or restore it."""
        for h in self.hosts.values():
            _sh("ip", "-n", h.netns, "link", "set", h.dev, "up" if up else "down")

    def link_bytes(self) -> int:
        """Bytes host a's end has sent plus received: everything that crossed the link."""
        a = self.hosts["a"]
        out = _sh("ip", "-n", a.netns, "-j", "-s", "link", "show", a.dev).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    # -- processes on a host ---------------------------------------------------------------

    def popen(
        self,
        args: Sequence[str],
        host: str = "a",
        env: dict[str, str | None] | None = None,
        **kw: Any,
    ) -> subprocess.Popen:
        """Start ``args`` on ``host`` (cwd: the repository), joined to the cluster by env."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].netns, *args],
            env=self.env(host, env),
            cwd=REPO,
            **kw,
        )

    def run_python(self, module: str, *args: str, timeout: float = 300, host: str = "a") -> Any:
        """Run ``python -m module args`` on ``host``; returns its last stdout line as JSON."""
        proc = self.popen(
            [sys.executable, "-m", module, *args],
            host=host,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{module} timed out after {timeout} s:\n{err[-4000:]}") from None
        if proc.returncode:
            raise AssertionError(f"{module} exited {proc.returncode}:\n{err[-4000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def client(self, command: str, run_timeout: float = 300, **kw: Any) -> Any:
        """A command of tests/two_hosts_client.py on host a, ``kw`` its arguments."""
        args = json.dumps(kw)
        return self.run_python("tests.two_hosts_client", command, args, timeout=run_timeout)


def _kill_netns(netns: str) -> int:
    pids = [int(p) for p in _sh("ip", "netns", "pids", netns, check=False).stdout.split()]
    for pid in pids:
        with suppress(ProcessLookupError):  # gone already
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _sh("ip", "netns", "pids", netns, check=False).stdout.split():
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return len(pids)


def _remove(tag: str) -> None:
    """Everything harness ``tag`` made: its processes, namespaces (the veth goes with them)
    and files."""
    for name in "ab":
        netns = f"{tag}{name}"
        if Path("/run/netns", netns).exists():
            _kill_netns(netns)
            _sh("ip", "netns", "del", netns, check=False)
    shutil.rmtree(STATE_DIR / tag, ignore_errors=True)


def sweep() -> None:
    """Remove harnesses whose owner process is gone (a test run killed before its cleanup)."""
    if not STATE_DIR.exists():
        return
    for d in STATE_DIR.iterdir():
        try:
            owner = int((d / "owner").read_text())
            os.kill(owner, 0)
        except (OSError, ValueError):
            _remove(d.name)


@contextmanager
def kvmesh_serve(
    hosts: TwoHosts,
    flags: Sequence[str],
    port: int = 8000,
    model: str = "tiny-random",
    answering: int = 1,
) -> Iterator[str]:
    """``kvmesh serve FLAGS`` on host a, as an operator runs it on the head machine after
    ``ray up``: an explicit ``--address`` and no ``RAY_AUTH_MODE`` (kvmesh must turn token
    auth on for the join itself). Yields its base URL once completions succeeded on
    ``answering`` different workers (a round-robin scenario that needs both: a worker on a
    slow host may start seconds after the first answers); stops it with SIGTERM (as Ctrl-C)
    at the end. Its output goes to ``serve.log`` in the harness dir.
    """
    url = f"http://{hosts.hosts['a'].ip}:{port}"
    log_path = hosts.dir / "serve.log"
    args = [
        sys.executable, "-m", "kvmesh.cluster", "serve", "--address", hosts.head,
        "--model", model, "--host", hosts.hosts["a"].ip, "--port", str(port), *flags,
    ]  # fmt: skip
    with open(log_path, "a") as log:
        proc = hosts.popen(
            args, env={"RAY_AUTH_MODE": None, "RAY_ADDRESS": None}, stdout=log, stderr=log
        )
        try:
            deadline = time.monotonic() + 300
            ask = {"base_url": url, "timeout": 5, "model": model, "workers": answering}
            while not hosts.client("wait_ready", **ask)["ready"]:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"kvmesh serve never answered:\n{serve_log(hosts)}")
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve_log(hosts: TwoHosts) -> str:
    """The end of ``kvmesh serve``'s output (for a failure message)."""
    return (hosts.dir / "serve.log").read_text()[-4000:]


def rate_bits(rate: str) -> float:
    """A tc rate ("20mbit", "1gbit") in bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, mult in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult
    raise ValueError(f"rate: use kbit, mbit or gbit, got {rate!r}")


def _burst(rate: str) -> str:
    """tbf's bucket for ``rate``: 8 ms of it, between 16 KiB and 1 MiB. tbf sends a full
    bucket at line rate after the link was idle, so a fixed 1 MiB let a slow link pass a
    whole tiny-random prefix (0.9 MB) unshaped; fast rates need a big bucket to reach their
    rate at all (a bucket refills once per timer tick)."""
    return str(min(max(int(rate_bits(rate) / 8 * 0.008), 16 << 10), 1 << 20))
