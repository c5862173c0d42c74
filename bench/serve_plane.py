"""Serve's own processes killed under load, then the command stopped through its process group.

`kvmesh serve --address local` (its own Ray; ``--model``, 2 workers, 2 ingress replicas)
serves a closed loop of ``--users`` HTTP users, each with one official ``openai`` client
(its connection kept alive) without retries: greedy, every other request streamed,
chaos_common's prompts (a shared system prompt). One phase of ``--phase-s`` per fault, the
fault ``--fault-after-s`` into it:

- ``controller``: Serve's controller killed (Ray restarts it);
- ``proxy``: Serve's HTTP proxy killed (Serve replaces it after three failed health checks;
  meanwhile connections are refused: a client that retries, as the official one does by
  default, gets its answer once the new proxy listens);
- ``ingress``: one of the two ingress replicas killed (the front door sends what it had not
  answered again; Serve replaces it).

Beside the HTTP users, ``--handle-users`` Python callers (a driver joined to the command's
Ray) send the same requests through the handle ``deploy`` gives, ``IngressHandle`` (the
replica's loss: sent again, as the front door does): counted under ``handle`` per fault.

Then SIGTERM to the command's whole process group, as ``kill -TERM -PGID`` or ``timeout`` send
it: the stop must drain in order and leave no Ray process.

One JSON line: ``scenario`` "serve_plane"; ``requests`` (sent, HTTP and handle), ``failed``
(sent, and not answered whole), ``wrong`` (an answer unlike the no-fault reference of an
in-process engine),
``refused`` (connections refused, each followed by a pause of ``REFUSED_BACKOFF_S``: no request
was sent, and a client that retries gets its answer later); per fault the same counts and the
failures' kinds; the stop's seconds, exit status and the Ray processes it left.

    .venv/bin/python bench/serve_plane.py [--model tiny-random] [--phase-s 20]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

# What each fault kills: the first process under the command whose title holds this.
FAULTS = {
    "controller": "ray::ServeController",
    "proxy": "ray::ProxyActor",
    "ingress": "ray::ServeReplica:kvmesh:KvmeshServer",
}
STOP_WITHIN_S = 120.0
REFUSED_BACKOFF_S = 0.5  # a user's pause after a refused connection, as a client's retry has


def add_load_args(p: argparse.ArgumentParser, phase_s: float) -> None:
    """The settings of ``load``'s closed loop (bench/upgrade.py's too)."""
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--prompts", type=int, default=24, help="distinct prompts, cycled")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--phase-s", type=float, default=phase_s)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p, phase_s=20.0)
    p.add_argument("--handle-users", type=int, default=4, help="Python callers beside them")
    p.add_argument("--fault-after-s", type=float, default=3.0)
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    return p.parse_args()


def titles(pid: int) -> list[tuple[psutil.Process, str]]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            out.append((p, " ".join(p.cmdline())))
    return out


def kill_first(pid: int, title: str) -> int:
    """SIGKILL the first process under ``pid`` whose title holds ``title``; its pid."""
    for p, cmdline in titles(pid):
        if title in cmdline:
            p.kill()
            return p.pid
    raise RuntimeError(f"no {title} under the command")


def serving(log: Path, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Until the command says it serves: its app deployed, every replica up."""
    deadline = time.monotonic() + timeout_s
    while "kvmesh: serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvmesh serve never served; see {log}")
        time.sleep(0.5)


class _Counted(logging.Handler):
    """Counts ``logger``'s records holding ``text`` until closed."""

    def __init__(self, logger: logging.Logger, text: str) -> None:
        super().__init__(logging.INFO)
        self.logger, self.text, self.n = logger, text, 0
        self.level_before = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.n += 1

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        super().close()


def handle_complete(handle: Any, text: str, max_tokens: int, stream: bool, model: str) -> dict:
    """``complete``'s request through the Python handle (its body, as a dict): the text, or
    the error's class and message, never raised."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    try:
        if not stream:
            return {
                "ok": True,
                "text": handle.completions.remote(body).result()["choices"][0]["text"],
            }
        chunks = handle.options(stream=True).completions.remote(body)
        return {
            "ok": True,
            "text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
        }
    except Exception as e:  # counted by its kind
        return {"ok": False, "cause": type(e).__name__, "error": str(e)[:200]}


def load(
    base: str,
    texts: list[str],
    ref: list[dict],
    args: argparse.Namespace,
    fault: Any,
    handle: Any | None = None,
) -> dict:
    """A closed loop of ``args.users`` HTTP users (and, given ``handle``, of
    ``args.handle_users`` handle callers) for ``args.phase_s``; ``fault`` runs
    ``args.fault_after_s`` into it. Counts, and the failures' kinds (the handle's apart)."""
    from tests.two_hosts_client import client, complete, streamed

    counter = itertools.count()
    lock = threading.Lock()
    counts: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + args.phase_s

    def count(r: dict, i: int, via: str) -> None:
        with lock:
            counts[f"{via}requests"] += 1
            if not r["ok"]:
                counts[f"{via}failed"] += 1
                kind = r.get("cause") or r.get("error")
                kinds[f"{via}{kind} {r['status']}" if r.get("status") else f"{via}{kind}"] += 1
            elif r["text"] != ref[i]["text"]:
                counts[f"{via}wrong"] += 1

    def user() -> None:
        api = client(base)  # one per user, its connection kept alive, as an application's
        while time.monotonic() < end:
            i = next(counter) % len(texts)
            r = complete(base, texts[i], args.max_tokens, streamed(i), model=args.model, api=api)
            if r.get("cause") == "ConnectError":  # refused: nothing was sent
                with lock:
                    counts["refused"] += 1
                time.sleep(REFUSED_BACKOFF_S)
                continue
            count(r, i, "")

    def handle_user() -> None:
        while time.monotonic() < end:
            i = next(counter) % len(texts)
            count(
                handle_complete(handle, texts[i], args.max_tokens, streamed(i), args.model),
                i,
                "handle ",
            )

    resent = _Counted(logging.getLogger("kvmesh.cluster.ingress_handle"), "sending it again")
    threads = [threading.Thread(target=user) for _ in range(args.users)]
    if handle is not None:
        threads += [threading.Thread(target=handle_user) for _ in range(args.handle_users)]
    for t in threads:
        t.start()
    time.sleep(args.fault_after_s)
    fault()
    for t in threads:
        t.join()
    resent.close()
    out = {key: counts[key] + counts[f"handle {key}"] for key in ("requests", "failed", "wrong")}
    out["refused"] = counts["refused"]
    if handle is not None:
        out["handle"] = {key: counts[f"handle {key}"] for key in ("requests", "failed", "wrong")}
        out["handle"]["sent_again"] = resent.n  # lost with their ingress replica, then answered
    out["kinds"] = dict(kinds)
    return out


def join(ray_tmpdir: str) -> Any:
    """This process as a driver of the command's Ray (its ``RAY_TMPDIR``), and the app's
    handle (``app_handle``: as ``deploy`` gives it)."""
    import ray

    from kvmesh.cluster import app_handle

    os.environ["RAY_TMPDIR"] = ray_tmpdir
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    return app_handle()


def main() -> None:
    args = parse_args()
    os.environ["KVMESH_CLIENT_MODEL"] = args.model  # the clients' and the reference's model
    from chaos_common import texts as chaos_texts

    from tests.ports import free_port
    from tests.two_hosts_client import reference, wait_ready

    texts = chaos_texts(args.prompts, salt=9)
    ref = reference(texts, args.max_tokens)["results"]
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="serve_plane-"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_TMPDIR", str(workdir))
    cmd = [sys.executable, "-m", "kvmesh.cluster", "serve", "--model", args.model,
           "--workers", "2", "--ingress-replicas", "2", "--port", str(port),
           "--address", "local"]  # fmt: skip
    row: dict[str, Any] = {"scenario": "serve_plane", "model": args.model, "faults": {}}
    with open(workdir / "serve.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            serving(workdir / "serve.log", proc)
            handle = join(env["RAY_TMPDIR"]) if args.handle_users else None
            for name, title in FAULTS.items():
                row["faults"][name] = load(
                    base, texts, ref, args, lambda title=title: kill_first(proc.pid, title), handle
                )
                if not wait_ready(base, timeout=120, model=args.model)["ready"]:
                    raise RuntimeError(f"kvmesh serve did not answer again after the {name} kill")
            descendants = [p for p, _ in titles(proc.pid)]
        finally:
            with contextlib.suppress(Exception):  # this driver leaves first: not the command's
                import ray

                ray.shutdown()
            sent = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)  # as `kill -TERM -PGID` and `timeout` do
            try:
                proc.wait(STOP_WITHIN_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            row["stop_s"] = round(time.monotonic() - sent, 1)
            row["stop_rc"] = proc.returncode
    _, alive = psutil.wait_procs(descendants, timeout=30)
    row["left_behind"] = len(alive)
    for p in alive:
        p.kill()
    for key in ("requests", "failed", "refused", "wrong"):
        row[key] = sum(f[key] for f in row["faults"].values())
    row["log"] = str(workdir / "serve.log")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
