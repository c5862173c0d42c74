"""LocalNodeProvider: Ray's NodeProvider over "nodes" that are process groups on this host.

Node state lives in one JSON file under ``provider.state_dir``, guarded by an fcntl lock: the
`ray up` / `ray down` processes and the autoscaler on the head each build their own provider
object and must see the same nodes. Each node gets a home directory (``~`` in its commands and
file mounts) under the same folder. Every node reports IP 127.0.0.1; autoscaler v2 (the
default of `ray up` since Ray 2.50) tells nodes apart by ``RAY_CLOUD_INSTANCE_ID``, not by IP.

Provider config keys (beyond ``type`` and ``module``):
    state_dir: a folder for the state file and the node homes (required).
    env: extra environment for node commands (PATH with the venv first, PYTHONPATH with the
        repo root so the autoscaler can import this module).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import TAG_RAY_NODE_KIND

from tests.local_provider.command_runner import LocalCommandRunner, stop_node_processes

LOCAL_IP = "127.0.0.1"


class NodeStore:
    """The nodes of one cluster: ``{"next": int, "nodes": {id: {"tags": {...}}}}``."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "nodes.json"
        self.lock_path = self.dir / "nodes.lock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """The state, exclusively; changes made to it inside the block are saved."""
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = self._read()
                yield state
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
                tmp.replace(self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def snapshot(self) -> dict[str, Any]:
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            try:
                return self._read()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"next": 0, "nodes": {}}
        return json.loads(self.path.read_text())

    def home(self, node_id: str) -> Path:
        return self.dir / "nodes" / node_id


class LocalNodeProvider(NodeProvider):
    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.store = NodeStore(Path(provider_config["state_dir"]))
        self.env = {str(k): str(v) for k, v in provider_config.get("env", {}).items()}

    def marker(self, node_id: str) -> str:
        """What tags this node's processes (see command_runner): unique per cluster."""
        return f"{self.store.dir}:{node_id}"

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        nodes = self.store.snapshot()["nodes"]
        return [
            node_id
            for node_id, node in sorted(nodes.items())
            if all(node["tags"].get(k) == v for k, v in tag_filters.items())
        ]

    def is_running(self, node_id: str) -> bool:
        return node_id in self.store.snapshot()["nodes"]

    def is_terminated(self, node_id: str) -> bool:
        return not self.is_running(node_id)

    def node_tags(self, node_id: str) -> dict[str, str]:
        return dict(self.store.snapshot()["nodes"][node_id]["tags"])

    def external_ip(self, node_id: str) -> str:
        return LOCAL_IP

    def internal_ip(self, node_id: str) -> str:
        return LOCAL_IP

    def create_node(
        self, node_config: dict[str, Any], tags: dict[str, str], count: int
    ) -> dict[str, Any]:
        created = {}
        with self.store.locked() as state:
            for _ in range(count):
                kind = tags.get(TAG_RAY_NODE_KIND, "node")
                node_id = f"{self.cluster_name}-{kind}-{state['next']}"
                state["next"] += 1
                self.store.home(node_id).mkdir(parents=True, exist_ok=True)
                state["nodes"][node_id] = {"tags": dict(tags), "config": node_config}
                created[node_id] = state["nodes"][node_id]
        return created

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        with self.store.locked() as state:
            state["nodes"][node_id]["tags"].update(tags)

    def terminate_node(self, node_id: str) -> dict[str, Any] | None:
        # The machine goes away: nothing it ran survives.
        stop_node_processes(self.marker(node_id))
        with self.store.locked() as state:
            state["nodes"].pop(node_id, None)
        return None

    def get_command_runner(
        self,
        log_prefix: str,
        node_id: str,
        auth_config: dict[str, Any],
        cluster_name: str,
        process_runner: Any,
        use_internal_ip: bool,
        docker_config: dict[str, Any] | None = None,
    ) -> LocalCommandRunner:
        home = self.store.home(node_id)
        home.mkdir(parents=True, exist_ok=True)
        return LocalCommandRunner(node_id, home, self.marker(node_id), self.env)

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        return cluster_config
