"""kvmesh.cluster: config, router, serving (Ray Serve + OpenAI API), CLI.

``deploy``, ``app_handle``, ``build_app`` and ``IngressHandle`` load Ray Serve on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IngressHandle", "ServeConfig", "app_handle", "build_app", "deploy"]


def __getattr__(name: str) -> Any:
    if name in ("deploy", "build_app", "app_handle"):
        from kvmesh.cluster import serve_app

        return getattr(serve_app, name)
    if name == "IngressHandle":
        from kvmesh.cluster.ingress_handle import IngressHandle

        return IngressHandle
    if name == "ServeConfig":
        from kvmesh.cluster.config import ServeConfig

        return ServeConfig
    raise AttributeError(f"module 'kvmesh.cluster' has no attribute {name!r}")
