"""Validation of Kubernetes objects as a strict validator (kubeconform -strict) would do it.

- ray.io objects: the KubeRay CRDs' ``openAPIV3Schema``, made strict: ``additionalProperties:
  false`` wherever a schema lists ``properties`` and says nothing about extra keys, unless it
  is marked ``x-kubernetes-preserve-unknown-fields``. So a typo anywhere, pod specs included,
  is an error, as the API server's pruning would silently drop it.
- core kinds: ``kubernetes_validate`` (bundled Kubernetes schemas, strict mode).
- Prometheus Operator kinds: a shape check of the fields we use (their CRDs are not here).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

CRD_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "kuberay-crds"
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
}
K8S_VERSION = kubernetes_validate.latest_version()
MONITORING_KINDS = {"ServiceMonitor": "endpoints", "PodMonitor": "podMetricsEndpoints"}

_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "additionalItems")


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema in which unknown fields are errors."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: strict(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [strict(sub) for sub in schema[key]]
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            out[key] = strict(schema[key])
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(kind: str, version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``kind`` at API ``version`` (e.g. v1), as the CRD has it."""
    # About 1 MB of YAML: libyaml's loader parses it ten times faster than the pure one.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{kind}: the CRD has no version {version}")


@functools.cache
def crd_validator(kind: str, version: str, strict_mode: bool = True) -> jsonschema.Validator:
    schema = crd_schema(kind, version)
    return jsonschema.Draft7Validator(strict(schema) if strict_mode else schema)


def _where(error: jsonschema.ValidationError) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "(root)"


def errors(obj: dict[str, Any]) -> list[str]:
    """Every problem with one object, as ``path: message`` lines; empty when valid."""
    group, _, version = obj.get("apiVersion", "").rpartition("/")
    kind = obj.get("kind", "")
    if group == "ray.io":
        validator = crd_validator(kind, version)
        return [f"{_where(e)}: {e.message}" for e in validator.iter_errors(obj)]
    if group == "monitoring.coreos.com":
        return _monitor_errors(obj)
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        # Its str() prints the whole schema; the path and message are what matter.
        return [f"{_where(e)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"(root): no Kubernetes {K8S_VERSION} schema for {obj.get('apiVersion')} {kind}"]
    return []


def _monitor_errors(obj: dict[str, Any]) -> list[str]:
    """The part of a ServiceMonitor/PodMonitor that Prometheus needs from us."""
    kind = obj["kind"]
    if kind not in MONITORING_KINDS or obj["apiVersion"] != "monitoring.coreos.com/v1":
        return [f"(root): unexpected {obj['apiVersion']} {kind}"]
    problems = []
    extra = set(obj) - {"apiVersion", "kind", "metadata", "spec"}
    if extra:
        problems.append(f"(root): unknown fields {sorted(extra)}")
    if not obj.get("metadata", {}).get("name"):
        problems.append("metadata/name: missing")
    spec = obj.get("spec", {})
    labels = spec.get("selector", {}).get("matchLabels")
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        problems.append("spec/selector/matchLabels: a non-empty map of strings is needed")
    endpoints = spec.get(MONITORING_KINDS[kind])
    if not endpoints:
        problems.append(f"spec/{MONITORING_KINDS[kind]}: at least one endpoint is needed")
    for i, ep in enumerate(endpoints or []):
        where = f"spec/{MONITORING_KINDS[kind]}/{i}"
        unknown = set(ep) - {"port", "path", "interval", "scheme", "scrapeTimeout"}
        if unknown:
            problems.append(f"{where}: unknown fields {sorted(unknown)}")
        if not isinstance(ep.get("port"), str) or not str(ep.get("path", "/")).startswith("/"):
            problems.append(f"{where}: needs a named port and a path")
    return problems
