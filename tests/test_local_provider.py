"""The test-only node provider that tests/test_ray_up_local.py runs `ray up` with: shared
node state, node commands in their own home, and a `ray stop` that stops one node only."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError
from ray.autoscaler.tags import NODE_KIND_HEAD, NODE_KIND_WORKER, TAG_RAY_NODE_KIND

from tests.local_provider.command_runner import node_processes
from tests.local_provider.provider import LocalNodeProvider


def provider(state_dir: Path) -> LocalNodeProvider:
    config = {"state_dir": str(state_dir), "env": {"KVMESH_TEST_VAR": "yes"}}
    return LocalNodeProvider(config, "c1")


def test_two_providers_share_the_nodes(tmp_path: Path) -> None:
    # `ray up` and the head's autoscaler each build their own provider over one state dir.
    a, b = provider(tmp_path), provider(tmp_path)
    a.create_node({}, {TAG_RAY_NODE_KIND: NODE_KIND_HEAD}, 1)
    b.create_node({}, {TAG_RAY_NODE_KIND: NODE_KIND_WORKER}, 2)
    assert a.non_terminated_nodes({}) == ["c1-head-0", "c1-worker-1", "c1-worker-2"]
    assert a.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD}) == ["c1-head-0"]
    b.set_node_tags("c1-worker-1", {"status": "up"})
    assert a.node_tags("c1-worker-1")["status"] == "up"
    a.terminate_node("c1-worker-2")
    assert b.is_terminated("c1-worker-2") and b.is_running("c1-worker-1")
    assert b.internal_ip("c1-worker-1") == "127.0.0.1"


def test_commands_run_in_the_node_home_with_its_environment(tmp_path: Path) -> None:
    p = provider(tmp_path)
    p.create_node({}, {TAG_RAY_NODE_KIND: NODE_KIND_WORKER}, 1)
    runner = p.get_command_runner("", "c1-worker-0", {}, "c1", subprocess, False)
    out = runner.run(
        "echo $HOME $KVMESH_TEST_VAR $ANSWER $(pwd)",
        with_output=True,
        environment_variables={"ANSWER": 42},  # JSON-encoded, as Ray does over ssh
    )
    home = str(tmp_path / "nodes" / "c1-worker-0")
    assert out.decode().split() == [home, "yes", "42", home]
    (tmp_path / "f.txt").write_text("mounted")
    runner.run_rsync_up(str(tmp_path / "f.txt"), "~/sub/f.txt")
    assert (Path(home) / "sub" / "f.txt").read_text() == "mounted"
    with pytest.raises(ProcessRunnerError):
        runner.run("exit 3")


def test_ray_stop_stops_one_node_and_nothing_else(tmp_path: Path) -> None:
    p = provider(tmp_path)
    p.create_node({}, {TAG_RAY_NODE_KIND: NODE_KIND_WORKER}, 2)
    one, two = (
        p.get_command_runner("", f"c1-worker-{i}", {}, "c1", subprocess, False) for i in (0, 1)
    )
    # Daemons, as `ray start` leaves them: detached, still holding the command's stdout.
    for runner in (one, two):
        runner.run("nohup sleep 300 >/dev/null 2>&1 &")
    outsider = subprocess.Popen(["sleep", "300"])
    try:
        deadline = time.monotonic() + 10
        while not (node_processes(one.marker) and node_processes(two.marker)):
            assert time.monotonic() < deadline, "the node daemons never showed up"
            time.sleep(0.1)
        with pytest.raises(ProcessRunnerError, match="refusing"):
            one.run("ray stop; ray start --head")
        one.run("ray stop")
        assert node_processes(one.marker) == []
        assert node_processes(two.marker) and outsider.poll() is None
        p.terminate_node("c1-worker-1")
        assert node_processes(two.marker) == []
        assert p.non_terminated_nodes({}) == ["c1-worker-0"]
    finally:
        outsider.kill()
        outsider.wait()
        for proc in node_processes(one.marker) + node_processes(two.marker):
            proc.kill()
