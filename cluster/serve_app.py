"""The Ray Serve application: one ingress deployment that owns the workers and the router.

- HTTP: the OpenAI routes of ``openai_api.build_api`` over ``ClusterBackend``.
- Python: ``handle.generate.remote(request)`` where ``request`` is a dict like an OpenAI
  body: ``prompt`` (text or token ids) or ``messages``, plus sampling fields. With
  ``"stream": True`` in the request *and* ``handle.options(stream=True)`` it yields chunks.
- ``build_app(args)`` is the Serve ``import_path`` target (serveConfigV2, KubeRay), and
  ``deploy(config)`` runs it from Python and returns the ``DeploymentHandle``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.frontend import ClusterBackend
from kvmesh.workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
APP_NAME = "kvmesh"
_SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "logprobs",
)
_ids = itertools.count()


def parse_request(d: dict[str, Any]) -> GenerateRequest:
    """A handle request dict -> GenerateRequest; ValueError naming the field on bad input."""
    if not isinstance(d, dict):
        raise ValueError("request: must be a dict")
    unknown = set(d) - {"prompt", "messages", "stream", "request_id", *_SAMPLING_KEYS}
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown field")
    if ("prompt" in d) == ("messages" in d):
        raise ValueError("prompt: give exactly one of prompt or messages")
    params = SamplingParams(**{k: d[k] for k in _SAMPLING_KEYS if k in d})
    rid = str(d.get("request_id") or f"kvmesh-{next(_ids)}")
    return GenerateRequest(rid, params, prompt=d.get("prompt"), messages=d.get("messages"))


def completion_dict(c: Completion) -> dict[str, Any]:
    return {
        "id": c.request_id,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "usage": {
            "prompt_tokens": len(c.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": c.cached_tokens,
        },
        "kvmesh": c.kv.to_dict(),
        "logprobs": c.logprobs,
    }


def chunk_dict(c: Chunk) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": c.request_id,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
    }
    if c.logprobs is not None:
        out["logprobs"] = c.logprobs
    if c.completion is not None:
        full = completion_dict(c.completion)
        out["usage"], out["kvmesh"] = full["usage"], full["kvmesh"]
    return out


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=512,
    ray_actor_options={"num_cpus": 0},  # the workers need the cores
)
@serve.ingress()
class KvmeshServer:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ServeConfig.from_dict(config)
        self.backend = ClusterBackend(self.config)

    def __serve_build_asgi_app__(self) -> Any:
        from kvmesh.cluster.metrics import ServeMetrics
        from kvmesh.cluster.openai_api import build_api

        return build_api(
            self.backend,
            model_name=self.config.model_name,
            api_key=self.config.api_key,
            metrics=ServeMetrics(),
        )

    async def generate(self, request: dict[str, Any]) -> Any:
        """The Python handle's entry point; see the module docstring."""
        req = parse_request(request)
        if request.get("stream"):
            return self._stream(req)
        return completion_dict(await self.backend.generate(req))

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.backend.stream(req):
            yield chunk_dict(chunk)

    async def stats(self) -> dict[str, Any]:
        return await self.backend.stats()

    async def kill_worker(self, name: str) -> None:
        """Fault injection for tests and drills: kill one worker actor."""
        import ray

        ray.kill(self.backend.workers[name])

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown()


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for ``args`` (ServeConfig fields); a Serve ``import_path``."""
    config = ServeConfig.from_dict(dict(args or {}))
    return KvmeshServer.bind(config.to_dict())


def deploy(config: ServeConfig) -> serve.handle.DeploymentHandle:
    """Run the app on the connected Ray cluster (HTTP on config.host:config.port) and return
    its handle. Call ``ray.init`` first, or this joins/starts one as Serve does."""
    serve.start(http_options={"host": config.host, "port": config.port})
    return serve.run(build_app(config.to_dict()), name=APP_NAME, route_prefix="/")
