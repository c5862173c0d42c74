"""`kvmesh demo`: a local cluster of 3 CPU workers (1 prefill + 2 decode replicas) serving two
multi-turn chats at once through the OpenAI HTTP API and the Python handle, with a table of
where each request's KV came from; then one decode worker is killed in the middle of an
answer, the answer goes on on the other, and the table says where it moved and whether the
text equals an unbroken run."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from typing import Any

SYSTEM = (
    "You are a concise assistant for engineers who run LLM inference clusters. "
    "Answer in two or three sentences, plainly, without lists."
)
CONVERSATIONS = [
    ["What is a KV cache?", "Why does reusing it across requests make serving faster?"],
    ["What does prefill mean in LLM serving?", "And what is decode?"],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(stop: threading.Event, what: str) -> None:
    start = time.monotonic()
    while not stop.wait(3):
        print(f"  ... {what} ({time.monotonic() - start:.0f} s)", flush=True)


def http_chat(port: int, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = json.dumps(
        {"model": model, "messages": messages, "max_tokens": 48, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    return {
        "text": out["choices"][0]["message"]["content"],
        "completion_tokens": out["usage"]["completion_tokens"],
        "kvmesh": out["kvmesh"],
    }


def run_demo(model: str = "smollm2-135m") -> None:
    import ray
    from ray import serve

    from kvmesh.cluster.config import ServeConfig
    from kvmesh.cluster.serve_app import APP_NAME, deploy

    config = ServeConfig(
        model=model,
        prefill_workers=1,
        decode_workers=2,
        kv_cache_memory="256MiB",
        port=free_port(),
        max_num_batched_tokens=256,
    )
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    threading.Thread(
        target=_progress, args=(stop, f"starting 3 workers, each loading {model}"), daemon=True
    ).start()
    try:
        print(f"kvmesh demo: {model} on 1 prefill + 2 decode CPU workers", flush=True)
        try:
            handle = deploy(config)
        finally:
            stop.set()
        rows = asyncio.run(_workload(handle, config))
        _print_table(rows)
        _print_failover(_failover(handle))
    finally:
        # Delete the app (Serve drains and stops the workers), then stop this Ray: no
        # controller is killed mid-call, so nothing is left to print after the tables.
        serve.delete(APP_NAME)
        ray.shutdown()


async def _workload(handle: Any, config: Any) -> list[dict[str, Any]]:
    """The two conversations at once: each turn waits for the last, the two do not."""
    results = await asyncio.gather(
        *(_conversation(handle, config, c, turns) for c, turns in enumerate(CONVERSATIONS))
    )
    return [row for rows in zip(*results, strict=True) for row in rows]


async def _conversation(handle: Any, config: Any, c: int, turns: list[str]) -> list[dict[str, Any]]:
    rows = []
    messages = [{"role": "system", "content": SYSTEM}]
    for t, question in enumerate(turns):
        messages.append({"role": "user", "content": question})
        via = "http" if (c + t) % 2 == 0 else "handle"
        start = time.perf_counter()
        if via == "http":
            out = await asyncio.to_thread(http_chat, config.port, config.model_name, messages)
        else:
            res = await handle.generate.remote(
                {"messages": messages, "max_tokens": 48, "temperature": 0}
            )
            out = {
                "text": res["text"],
                "completion_tokens": res["usage"]["completion_tokens"],
                "kvmesh": res["kvmesh"],
            }
        wall = time.perf_counter() - start
        messages.append({"role": "assistant", "content": out["text"]})
        rows.append({"request": f"c{c}t{t}", "via": via, "wall": wall, **out})
        print(f"  c{c}t{t} ({via}) done in {wall:.1f} s", flush=True)
    return rows


def _failover(handle: Any) -> dict[str, Any]:
    """One answer streamed twice: unbroken, then with its decode worker killed midway."""
    import ray

    from kvmesh.cluster.serve_app import APP_NAME, WORKER_DEPLOYMENT_PREFIX

    body = {
        "messages": [{"role": "user", "content": "Explain paged attention to a new engineer."}],
        "max_tokens": 64,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 7,
    }
    print(
        "\nfailover: the same seeded answer, unbroken and then with its worker killed", flush=True
    )
    unbroken = handle.generate.remote(body).result()
    chunks: list[dict[str, Any]] = []
    killed = None
    for chunk in handle.options(stream=True).generate.remote({**body, "stream": True}):
        chunks.append(chunk)
        if len(chunks) == 16:
            busy = [
                w
                for w, load in handle.stats.remote().result()["workers"].items()
                if w.startswith("decode-") and (load["running"] or load["waiting"])
            ]
            if busy:
                killed = busy[0]
                _, replica_id = killed.split("-", 1)
                name = f"SERVE_REPLICA::{APP_NAME}#{WORKER_DEPLOYMENT_PREFIX}decode#{replica_id}"
                ray.kill(ray.get_actor(name, namespace="serve"))
                print(f"  killed {killed} after {len(chunks)} tokens", flush=True)
    text = "".join(c["text"] for c in chunks)
    return {
        "killed": killed,
        "now": chunks[-1]["kvmesh"]["worker"],
        "migrations": chunks[-1]["kvmesh"]["migrations"],
        "tokens": sum(len(c["token_ids"]) for c in chunks),
        "equal": text == unbroken["text"],
        "text": text,
    }


def _print_failover(r: dict[str, Any]) -> None:
    head = f"{'killed':<16} {'moved to':<16} {'migrations':>10} {'tokens':>6} {'= unbroken':>10}"
    print("\n" + head + "\n" + "-" * len(head))
    print(
        f"{r['killed'] or '-':<16} {r['now']:<16} {r['migrations']:>10} {r['tokens']:>6} "
        f"{'yes' if r['equal'] else 'NO':>10}"
    )
    answer = " ".join(r["text"].split())
    print(f"answer: {answer[:100]}{'...' if len(answer) > 100 else ''}")


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'req':<5} {'via':<6} {'prefill':<16} {'decode':<16} {'local':>5} {'pulled':>6} "
        f"{'computed':>8} {'TTFT ms':>8} {'tok/s':>6}  answer"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        kv = r["kvmesh"]
        tps = r["completion_tokens"] / r["wall"] if r["wall"] else 0.0
        answer = " ".join(r["text"].split())
        print(
            f"{r['request']:<5} {r['via']:<6} {kv.get('prefill_worker') or '-':<16} "
            f"{kv['worker']:<16} {kv['local_hit_tokens']:>5} {kv['pulled_tokens']:>6} "
            f"{kv['computed_tokens']:>8} {kv['ttft_ms'] or 0:>8.0f} {tps:>6.1f}  "
            f"{answer[:50]}{'...' if len(answer) > 50 else ''}"
        )
    print(
        "\nlocal: prompt tokens hit in the decode worker's own prefix cache; pulled: read from "
        "a peer over NIXL;\ncomputed: run through the model on the decode worker (the prefill "
        "worker computed the rest first)."
    )
