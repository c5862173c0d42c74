"""Helpers for tests of the Serve app: configs, replica lookup, fault injection, waiting."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from ray import serve

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_app import APP_NAME, WORKER_DEPLOYMENT_PREFIX, deploy
from tests.ports import free_port

# The session's Serve keeps the HTTP port it started with (a later serve.start's
# http_options are not applied): every app of the session serves on this one.
SERVE_PORT = free_port()


def tiny_config(**kw: Any) -> ServeConfig:
    base = {
        "model": "tiny-random",
        "block_size": 4,
        "kv_cache_memory": "8MiB",
        "num_cpus_per_worker": 0.5,
        "port": SERVE_PORT,
    }
    return ServeConfig(**{**base, **kw})


def unified_app() -> tuple[Any, openai.OpenAI, ServeConfig]:
    """tiny-random on two unified workers, round robin, deployed: its handle, the official
    client over HTTP, its config."""
    config = tiny_config(workers=2, router="round_robin")
    handle = redeploy(config)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{config.port}/v1", api_key="none")
    return handle, client, config


def tiny_reference() -> LLM:
    """An in-process engine on the model the test apps serve, for their expected outputs."""
    return LLM("tiny-random", block_size=4, num_kv_blocks=256, progress=False)


def redeploy(config: ServeConfig) -> Any:
    """Replace the session's kvmesh app with ``config``'s; Serve's controller and proxy stay
    up (stopping and starting them costs ~8 s here). Returns the new app's handle."""
    undeploy()
    return deploy(config)


def undeploy() -> None:
    """Delete the kvmesh app, if one runs: its replicas stop and give their CPUs back."""
    if APP_NAME in serve.status().applications:
        serve.delete(APP_NAME)


def replica_actor(worker: str) -> Any:
    """The Serve replica actor of worker ``<role>-<replica id>``."""
    role, unique_id = worker.split("-", 1)
    name = f"SERVE_REPLICA::{APP_NAME}#{WORKER_DEPLOYMENT_PREFIX}{role}#{unique_id}"
    return ray.get_actor(name, namespace="serve")


def kill_worker(worker: str) -> None:
    """Kill a worker replica as a crash would (its engine actor dies with it)."""
    ray.kill(replica_actor(worker), no_restart=True)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed and not yet reaped, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running_replicas(role: str = "worker") -> int:
    """How many of the role's replicas Serve reports RUNNING."""
    app = serve.status().applications[APP_NAME]
    return app.deployments[f"{WORKER_DEPLOYMENT_PREFIX}{role}"].replica_states.get("RUNNING", 0)


def replica_log(deployment: str) -> str:
    """Every Serve log line of ``deployment``'s replicas in this Ray session (its file per
    replica under logs/serve/)."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    files = sorted(logs.glob(f"replica_{APP_NAME}_{deployment}_*.log"))
    return "".join(f.read_text(errors="replace") for f in files)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def served_fingerprint() -> str:
    """The served model's fingerprint (it names the index actor), from a worker replica."""
    workers = serve.get_deployment_handle(f"{WORKER_DEPLOYMENT_PREFIX}worker", APP_NAME)
    return workers.worker_info.remote().result()["fingerprint"]


def busy_worker(handle: Any) -> str | None:
    """The worker with a running request, from the app's stats (None if none yet)."""
    workers = handle.stats.remote().result()["workers"]
    busy = [w for w, load in workers.items() if load["running"] or load["waiting"]]
    return busy[0] if busy else None


def check_prompt_logprobs(handle, reference: LLM, model_name: str) -> dict:
    """An echo with logprobs of a cached prompt: computed again, its logprobs the engine's;
    the handle's own dict takes prompt_logprobs too. Returns the last answer's ``kvmesh``."""
    ids = list(range(9, 40))
    handle.generate.remote({"prompt": ids, "max_tokens": 1}).result()  # cache it
    want = reference.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    # ignore_eos: the count below is exact; sampled at OpenAI's default temperature of 1, the
    # tiny model ends at EOS after one token about once in 400 (a CI run failed on it).
    body = {"model": model_name, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2}
    body["ignore_eos"] = True
    out = handle.completions.remote(body).result()
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 2
    want_lps = [entry[tok] for entry, tok in zip(want.prompt_logprobs[1:], ids[1:], strict=True)]
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want_lps, abs=1e-5)
    assert out["kvmesh"]["computed_tokens"] == len(ids)
    raw = handle.generate.remote({"prompt": ids, "max_tokens": 2, "prompt_logprobs": 0}).result()
    got = raw["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    assert [e[t] for e, t in zip(got[1:], ids[1:], strict=True)] == pytest.approx(
        want_lps, abs=1e-5
    )
    return raw["kvmesh"]
