"""Where replicas go: ``worker_resources`` / ``ingress_resources`` from the config, the flags
and the YAML file onto the Serve deployments (no Ray needed to build the app)."""

from __future__ import annotations

import argparse

import pytest

from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_app import build_app
from kvmesh.cluster.serve_flags import add_serve_args, config_from_args


def test_resources_reach_the_deployments() -> None:
    app = build_app(
        {
            "model": "tiny-random",
            "prefill_workers": 1,
            "decode_workers": 1,
            "num_gpus_per_worker": 0,
            "worker_resources": {"gpu_host": 1},
            "ingress_resources": {"cpu_node": 0.5},
        }
    )
    ingress = app._bound_deployment
    assert ingress.ray_actor_options["resources"] == {"cpu_node": 0.5}
    workers = ingress.init_args[1]
    assert set(workers) == {"prefill", "decode"}
    for bound in workers.values():
        bundles = bound._bound_deployment._replica_config.placement_group_bundles
        assert bundles == [{"gpu_host": 1, "CPU": 1.0}]


def test_flags_and_yaml(tmp_path) -> None:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    config = config_from_args(p.parse_args(["--worker-resources", '{"host_b": 1}']))
    assert config.worker_resources == {"host_b": 1}
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("ingress-resources:\n  cpu_node: 0.01\n")
    assert config_from_args(p.parse_args(["--config", str(yaml_file)])).ingress_resources == {
        "cpu_node": 0.01
    }
    with pytest.raises(SystemExit):
        p.parse_args(["--worker-resources", "[1]"])


@pytest.mark.parametrize(
    "bad", [{"a": -1}, {"a": 0}, {"a": "1"}, {"a": float("inf")}, {1: 1}, [("a", 1)]]
)
def test_bad_resources_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="worker_resources"):
        ServeConfig(worker_resources=bad)  # type: ignore[arg-type]
