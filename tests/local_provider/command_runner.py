"""Runs a fake node's commands on this machine, and stops exactly that node's processes.

Every process a node command starts carries ``KVMESH_LOCAL_NODE=<marker>`` in its
environment (Ray passes its environment down to raylets, agents and workers), so one node's
processes can be found and stopped without touching any other Ray on the host. That is also
what ``ray stop`` means here: a real ``ray stop`` would kill every Ray process on the machine,
including other clusters and a test session's own Ray.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil
from ray.autoscaler._private.command_runner import _with_environment_variables
from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError
from ray.autoscaler.command_runner import CommandRunnerInterface

MARKER_ENV = "KVMESH_LOCAL_NODE"
_RAY_STOP = re.compile(r"\s*ray\s+stop(\s.*)?", re.DOTALL)


def node_processes(marker: str) -> list[psutil.Process]:
    """Live processes (zombies excluded) whose environment carries ``marker``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARKER_ENV) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stop_node_processes(marker: str, grace_s: float = 2.0) -> int:
    """SIGTERM every process of one node, SIGKILL what outlives ``grace_s``; how many.

    A short grace: with all of a node's processes signalled at once, gcs_server and raylet
    sit out any grace period anyway, and a terminated node is a machine switched off.
    """
    procs = node_processes(marker)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


class LocalCommandRunner(CommandRunnerInterface):
    """bash on this machine, in the node's home directory, with the node's environment."""

    def __init__(self, node_id: str, home: Path, marker: str, env: dict[str, str]) -> None:
        self.node_id = node_id
        self.home = home
        self.marker = marker
        self.env = env

    def _environment(self) -> dict[str, str]:
        # A fresh login, not the caller's environment: the autoscaler on the head runs this
        # too, and its RAY_* variables (instance id, resources) belong to the head.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(self.env)
        env["HOME"] = str(self.home)
        env[MARKER_ENV] = self.marker
        return env

    def run(
        self,
        cmd: str | None = None,
        timeout: int = 120,
        exit_on_fail: bool = False,
        port_forward: Any = None,
        with_output: bool = False,
        environment_variables: dict[str, object] | None = None,
        run_env: str = "auto",
        ssh_options_override_ssh_key: str = "",
        shutdown_after_run: bool = False,
    ) -> Any:
        if cmd is None:
            raise ProcessRunnerError("no interactive shell on a local node", "unsupported")
        if _RAY_STOP.fullmatch(cmd):
            stop_node_processes(self.marker)
            return b"" if with_output else 0
        if re.search(r"\bray\s+stop\b", cmd):
            raise ProcessRunnerError(
                "refusing `ray stop` inside a command: on a shared host it stops every Ray",
                "ssh_command_failed",
                command=cmd,
            )
        if environment_variables:
            cmd = _with_environment_variables(cmd, environment_variables)
        # Output goes to a file, never a pipe: `ray start` leaves daemons holding the
        # command's stdout open, and a pipe would then never reach EOF.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.run(
                ["bash", "-c", cmd],
                cwd=self.home,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err if with_output else subprocess.STDOUT,
                start_new_session=True,
                check=False,
            )
            out.seek(0)
            err.seek(0)
            output, errors = out.read(), err.read()
        if not with_output:
            sys.stdout.write(output.decode(errors="replace"))
            sys.stdout.flush()
        sys.stderr.write(errors.decode(errors="replace"))
        if proc.returncode != 0:
            raise ProcessRunnerError(
                "Command failed", "ssh_command_failed", code=proc.returncode, command=cmd
            )
        return output if with_output else 0

    def _local(self, path: str) -> str:
        if path.startswith("~"):
            return str(self.home) + path[1:]
        return path

    def run_rsync_up(self, source: str, target: str, options: dict[str, Any] | None = None) -> None:
        _copy(os.path.expanduser(source), self._local(target))

    def run_rsync_down(
        self, source: str, target: str, options: dict[str, Any] | None = None
    ) -> None:
        _copy(self._local(source), os.path.expanduser(target))

    def remote_shell_command_str(self) -> str:
        return f"cd {self.home} && HOME={self.home} {MARKER_ENV}={self.marker} bash\n"

    def run_init(
        self, *, as_head: bool, file_mounts: dict[str, str], sync_run_yet: bool
    ) -> bool | None:
        return None


def _copy(source: str, target: str) -> None:
    """rsync semantics for what the updater sends: a directory's contents, or one file."""
    if os.path.isdir(source):
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        shutil.copy2(source, target)
