"""The Kubernetes manifests: every object validates strictly (KubeRay v1 CRDs, Kubernetes
core schemas), the Serve config inside the RayService deploys kvmesh's real entry point, the
pieces point at each other (Service -> head serve port, monitors -> Service and pods), and the
kustomizations render to the same valid objects (base: GPUs; overlays/cpu: none)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from kvmesh.cluster.config import API_KEY_ENV, ServeConfig
from kvmesh.workers.memory_size import parse_memory
from tests.k8s_validation import CRD_DIR, crd_validator, errors

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
BASE_FILES = sorted(
    p for p in (MANIFESTS / "base").glob("*.yaml") if p.name != "kustomization.yaml"
)
GPU = "nvidia.com/gpu"

requires_crds = pytest.mark.skipif(
    not CRD_DIR.is_dir(), reason=f"KubeRay CRDs not found at {CRD_DIR}: ray.io objects unchecked"
)
requires_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl not installed: kustomizations not rendered"
)


def load(path: Path) -> list[dict[str, Any]]:
    return [obj for obj in yaml.safe_load_all(path.read_text()) if obj]


def by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {obj["kind"]: obj for obj in objs}


BASE = {p.name: load(p) for p in BASE_FILES}
BASE_OBJECTS = [obj for objs in BASE.values() for obj in objs]


def cluster_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = cluster_spec(obj)
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [g["template"] for g in groups]


def serve_apps(rayservice: dict[str, Any]) -> tuple[ServeDeploySchema, list[ServeConfig]]:
    """The RayService's Serve config and its apps' ServeConfigs; the Serve controller's
    environment installs kvmesh's front door in the proxies and checks them as often, as
    ``serve_app.deploy`` does."""
    from kvmesh.cluster.front_door import CALLBACK, CALLBACK_ENV
    from kvmesh.cluster.serve_app import PROXY_HEALTH_CHECK_PERIOD_S, PROXY_HEALTH_ENV

    schema = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    assert schema.controller_options is not None
    env = {CALLBACK_ENV: CALLBACK, PROXY_HEALTH_ENV: PROXY_HEALTH_CHECK_PERIOD_S}
    assert schema.controller_options.runtime_env == {"env_vars": env}
    return schema, [ServeConfig.from_dict(app.args) for app in schema.applications]


def check_all(objs: list[dict[str, Any]]) -> None:
    problems = [f"{o['kind']}/{o['metadata']['name']}: {e}" for o in objs for e in errors(o)]
    assert not problems, "\n".join(problems)


def quantity(value: str) -> int:
    """Bytes of a Kubernetes memory or storage quantity ("34Gi", "512Mi")."""
    return parse_memory(f"{value}B" if value.endswith("i") else value)


def worker_room(rayservice: dict[str, Any]) -> tuple[ServeConfig, dict[str, Any], int]:
    """The app's config, the worker group's pod spec, and how many kvmesh workers one of its
    pods runs (its CPU and GPU limits over a worker's share)."""
    _, (config,) = serve_apps(rayservice)
    (worker,) = cluster_spec(rayservice)["workerGroupSpecs"]
    pod = worker["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    fits = [int(int(limits["cpu"]) / config.num_cpus_per_worker)]
    if config.num_gpus_per_worker:
        fits.append(int(int(limits[GPU]) / config.num_gpus_per_worker))
    return config, pod, min(fits)


def check_tier_room(rayservice: dict[str, Any]) -> None:
    """The disk tier lies on a volume of the node's disk that holds every worker's slot (the
    kubelet evicts a pod past an emptyDir's sizeLimit, which kvmesh's own check of the disk's
    free space cannot see), on a node picked for that much; the pod's memory, less its
    memory-backed volumes, holds each worker's host tier and (on CPU) pool with 1 GiB more."""
    config, pod, workers = worker_room(rayservice)
    assert workers >= 1
    (container,) = pod["containers"]
    if config.disk_cache_dir:
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == config.disk_cache_dir]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"].get("medium", "") == ""  # the disk, not the pod's memory
        size_limit = quantity(volume["emptyDir"]["sizeLimit"])
        slots = workers * parse_memory(config.disk_cache_size)
        assert size_limit >= slots, f"the disk tier's volume holds {size_limit} < {slots} bytes"
        assert quantity(container["resources"]["requests"]["ephemeral-storage"]) >= size_limit
    in_memory = sum(
        quantity(v["emptyDir"]["sizeLimit"])
        for v in pod["volumes"]
        if v.get("emptyDir", {}).get("medium") == "Memory"
    )
    per_worker = parse_memory(config.host_cache_memory) + 2**30
    if not config.num_gpus_per_worker:
        per_worker += parse_memory(config.kv_cache_memory)
    limit = quantity(container["resources"]["limits"]["memory"])
    assert limit - in_memory >= workers * per_worker, (limit, in_memory, workers, per_worker)


def test_the_tiers_fit_the_gpu_pods() -> None:
    rayservice = by_kind(BASE_OBJECTS)["RayService"]
    config, _, workers = worker_room(rayservice)
    assert config.disk_cache_dir and parse_memory(config.host_cache_memory) > 0
    assert workers == 1  # one GPU a pod
    check_tier_room(rayservice)


def test_a_disk_tier_larger_than_its_volume_is_caught() -> None:
    rayservice = copy.deepcopy(by_kind(BASE_OBJECTS)["RayService"])
    schema = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    schema["applications"][0]["args"]["disk_cache_size"] = "64GiB"
    rayservice["spec"]["serveConfigV2"] = yaml.safe_dump(schema)
    with pytest.raises(AssertionError, match="the disk tier's volume holds"):
        check_tier_room(rayservice)


@requires_crds
@pytest.mark.parametrize("name", [p.name for p in BASE_FILES])
def test_objects_validate_strictly(name: str) -> None:
    check_all(BASE[name])


def test_ray_start_params_are_strings() -> None:
    for obj in BASE_OBJECTS:
        if obj["apiVersion"].startswith("ray.io/"):
            spec = cluster_spec(obj)
            for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
                params = group["rayStartParams"]
                assert all(isinstance(v, str) for v in params.values()), params


def test_serve_config_deploys_kvmesh() -> None:
    from kvmesh.cluster import serve_app

    schema, configs = serve_apps(by_kind(BASE_OBJECTS)["RayService"])
    assert schema.http_options.port == 8000
    (app,) = schema.applications
    module, _, attr = app.import_path.partition(":")
    assert module == "kvmesh.cluster.serve_app" and callable(getattr(serve_app, attr))
    assert serve_app.build_app(app.args) is not None  # the args build the real application
    assert configs[0].num_gpus_per_worker == 1


def test_gpu_workers_and_head() -> None:
    for obj in BASE_OBJECTS:
        if not obj["apiVersion"].startswith("ray.io/"):
            continue
        spec = cluster_spec(obj)
        assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]
        assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
        for template in pod_specs(obj):
            pod = template["spec"]
            (container,) = pod["containers"]
            assert container["image"].startswith("ghcr.io/kvmesh/kvmesh:")
            assert {"requests", "limits"} <= set(container["resources"])
            shm = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}
            assert any(
                v["name"] in shm and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"]
            )
        (worker,) = spec["workerGroupSpecs"]
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
        pod = worker["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"][GPU] == "1"
        assert any(t["key"] == GPU for t in pod["tolerations"])


def test_the_api_key_comes_from_a_secret_never_from_the_manifest() -> None:
    """Every Ray pod of the RayService reads KVMESH_API_KEY from one optional Secret (Serve
    may build the app on any of them), the manual RayCluster's head too (where `kvmesh
    serve` runs); no app's args hold a key; the ServiceMonitor's comment names that Secret."""
    secret = {"secretKeyRef": {"name": "kvmesh-api-key", "key": "key", "optional": True}}
    want = {"name": API_KEY_ENV, "valueFrom": secret}
    objs = by_kind(BASE_OBJECTS)
    for template in pod_specs(objs["RayService"]):
        assert want in template["spec"]["containers"][0]["env"]
    head = cluster_spec(objs["RayCluster"])["headGroupSpec"]["template"]
    assert want in head["spec"]["containers"][0]["env"]
    _, configs = serve_apps(objs["RayService"])
    assert configs and all(c.api_key is None for c in configs)
    assert "name: kvmesh-api-key, key: key" in (MANIFESTS / "base" / "monitoring.yaml").read_text()


def test_service_and_monitors_point_at_the_right_things() -> None:
    objs = by_kind(BASE_OBJECTS)
    service, head = objs["Service"], objs["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]
    head_labels = {**head["template"]["metadata"]["labels"], "ray.io/node-type": "head"}
    assert service["spec"]["selector"].items() <= head_labels.items()
    (port,) = service["spec"]["ports"]
    head_ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert port["port"] == 8000 and head_ports[port["targetPort"]] == 8000

    monitor = objs["ServiceMonitor"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    pod_monitor = objs["PodMonitor"]
    for template in pod_specs(objs["RayService"]):
        assert (
            pod_monitor["spec"]["selector"]["matchLabels"].items()
            <= template["metadata"]["labels"].items()
        )
        names = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= names


@requires_crds
@pytest.mark.parametrize(
    ("where", "typo"),
    [
        (("spec",), "serveConfigv2"),
        (("spec", "rayClusterConfig"), "enableInTreeAutoScaling"),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0), "minReplica"),
        (
            ("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0),
            "volumeMount",
        ),
    ],
)
def test_a_typo_fails_strict_validation(where: tuple[str | int, ...], typo: str) -> None:
    broken = copy.deepcopy(by_kind(BASE_OBJECTS)["RayService"])
    node: Any = broken
    for key in where:
        node = node[key]
    node[typo] = node.get(typo.lower(), {})
    assert any(f"'{typo}' was unexpected" in e for e in errors(broken)), errors(broken)
    # The CRD's schema as it is lets it through (the API server would drop the field
    # silently): strictness is what catches it.
    assert not list(crd_validator("RayService", "v1", strict_mode=False).iter_errors(broken))


@requires_crds
def test_a_numeric_ray_start_param_fails() -> None:
    broken = copy.deepcopy(by_kind(BASE_OBJECTS)["RayService"])
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert any("is not of type 'string'" in e for e in errors(broken))


def test_a_typo_in_the_service_fails() -> None:
    broken = copy.deepcopy(by_kind(BASE_OBJECTS)["Service"])
    broken["spec"]["ports"][0]["targetport"] = 8000
    assert any("'targetport' was unexpected" in e for e in errors(broken))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, path in (("base", MANIFESTS / "base"), ("cpu", MANIFESTS / "overlays" / "cpu")):
        proc = subprocess.run(
            ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        out[name] = [obj for obj in yaml.safe_load_all(proc.stdout) if obj]
    return out


@requires_kubectl
@requires_crds
@pytest.mark.parametrize("name", ["base", "cpu"])
def test_kustomizations_render_valid_objects(rendered: dict, name: str) -> None:
    check_all(rendered[name])
    assert all(
        o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvmesh" for o in rendered[name]
    )


@requires_kubectl
def test_cpu_overlay_serves_smollm2_without_gpus(rendered: dict) -> None:
    objs = by_kind(rendered["cpu"])
    assert set(objs) == {"RayService", "Service"}  # no Prometheus Operator on kind/minikube
    _, (config,) = serve_apps(objs["RayService"])
    assert config.model == "smollm2-135m" and config.num_gpus_per_worker == 0
    text = yaml.safe_dump(objs["RayService"])
    assert GPU not in text and "tolerations" not in text
    for template in pod_specs(objs["RayService"]):
        assert template["spec"]["containers"][0]["image"].endswith("-cpu")
    # Each kvmesh worker's CPU fits in the worker pods the autoscaler may add.
    (worker,) = objs["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    cpus = int(worker["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert config.num_unified_workers * config.num_cpus_per_worker <= cpus * worker["maxReplicas"]
    check_tier_room(objs["RayService"])  # two workers a pod, each with a disk tier
    assert config.disk_cache_dir and worker_room(objs["RayService"])[2] == 2
    assert set(by_kind(rendered["base"])) == {
        "RayService",
        "Service",
        "ServiceMonitor",
        "PodMonitor",
    }
