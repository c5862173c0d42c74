"""The test side of a `ray up` on this machine: ports, config, logs, up, down, leftovers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
from ray.autoscaler.tags import (
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_STATUS,
)

from tests.local_provider.command_runner import MARKER_ENV, stop_node_processes
from tests.local_provider.provider import NodeStore
from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
TEMPLATE = Path(__file__).with_name("cluster.yaml")
# One port for everything that would otherwise bind a fixed default.
_AGENT_PORTS = ("agent_port", "agent_grpc_port", "metrics_port", "runtime_env_port")
PORT_NAMES = [
    *("gcs_port", "head_client_port", "serve_port"),
    *(f"{node}_{kind}" for node in ("head", "worker") for kind in _AGENT_PORTS),
]


def tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of a log file, or a note that it does not exist."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} not found)"


def wait_for(
    done: Callable[[], bool], timeout_s: float, why: Callable[[], str], poll_s: float = 1.0
) -> None:
    """Poll ``done`` until true; after ``timeout_s`` fail with ``why()``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(why())
        time.sleep(poll_s)


def clean_env() -> dict[str, str]:
    """This process's environment minus any Ray setting (RAY_ADDRESS above all), with the
    venv first on PATH and the repo importable (the provider module lives in tests/)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_UP_enable_autoscaler_v2"] = "1"  # Ray's default; said so to silence the notice
    return env


class LocalCluster:
    """One `ray up` cluster of this machine, with its own name, ports, temp dir and state."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        # Short: Ray's Unix sockets live under it and their paths must stay below 108 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
        self.state_dir = work / "state"
        self.store = NodeStore(self.state_dir)
        self.config = work / "cluster.yaml"
        self.log = work / "ray.log"
        self.gcs_address = f"127.0.0.1:{self.ports['gcs_port']}"
        values = {
            "cluster_name": f"kvmesh-t{uuid.uuid4().hex[:8]}",
            "state_dir": self.state_dir,
            "path": clean_env()["PATH"],
            "repo_root": REPO,
            "user": os.environ.get("USER", "root"),
            "temp_dir": self.temp_dir,
            **self.ports,
        }
        text = TEMPLATE.read_text()
        for key, value in values.items():
            text = text.replace("{{" + key + "}}", str(value))
        assert "{{" not in text, "a double-braced name in cluster.yaml was left unfilled"
        self.config.write_text(text)

    def ray(self, *args: str, timeout: float = 240) -> str:
        """Run the `ray` CLI (output appended to self.log); its output, or fail with it."""
        tmp = self.work / "tmp"  # `ray up`/`ray down` cache the bootstrapped config in TMPDIR
        tmp.mkdir(exist_ok=True)
        start = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            proc = subprocess.run(
                [str(VENV_BIN / "ray"), *args],
                cwd=REPO,
                env={**clean_env(), "TMPDIR": str(tmp)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        assert proc.returncode == 0, f"ray {args[0]} failed\n{self.logs()}"
        return self.log.read_bytes()[start:].decode(errors="replace")

    def worker_up(self) -> bool:
        """The autoscaler's worker node has finished its setup and `ray start`."""
        return any(
            n["tags"].get(TAG_RAY_NODE_KIND) == NODE_KIND_WORKER
            and n["tags"].get(TAG_RAY_NODE_STATUS) == STATUS_UP_TO_DATE
            for n in self.store.snapshot()["nodes"].values()
        )

    def markers(self) -> list[str]:
        nodes = self.state_dir / "nodes"
        return [f"{self.state_dir}:{n}" for n in os.listdir(nodes)] if nodes.exists() else []

    def survivors(self) -> list[str]:
        """Live processes of this cluster, by environment marker or command line."""
        markers = self.markers()
        needles = [str(self.temp_dir), str(self.state_dir), f":{self.ports['gcs_port']}"]
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                marked = proc.environ().get(MARKER_ENV) in markers
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                marked = False
            cmdline = " ".join(proc.info["cmdline"] or [])
            if marked or any(needle in cmdline for needle in needles):
                found.append(f"{proc.pid}: {cmdline[:200]}")
        return found

    def logs(self, *extra: Path) -> str:
        # The caller's own logs first and last: a report that keeps only the start and the
        # end of a long message keeps them either way.
        ray = sorted(self.temp_dir.glob("session_*/logs/monitor*"))
        ray += sorted(self.temp_dir.glob("session_*/logs/serve/controller_*.log"))
        own = [f"--- {p} ---\n{tail(p, 25)}" for p in extra]
        rest = [f"--- {p} ---\n{tail(p)}" for p in (*ray, self.log, *extra)]
        return "\n".join([*own, *rest])

    def cleanup(self, *, kill: bool) -> None:
        """Remove the temp dir; after a failure (``kill``) first stop what is left running."""
        if kill:
            for marker in self.markers():
                stop_node_processes(marker, grace_s=2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
