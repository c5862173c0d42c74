"""A restart with a disk tier: what a stopped server's next start finds.

`kvmesh serve --address local` (its own Ray; ``--model``, one worker whose pool holds about one
prompt, a host tier and a disk tier in a temporary directory) answers ``--prompts`` prompts
that share nothing, one at a time (each pushes the ones before down into the tiers), greedy,
through the official client. Then SIGINT to the command's process group (as Ctrl-C), the same
command again, and the same prompts. Side by side, each prompt the first time (computed) and
after the restart: the evicted prompts come back from disk, and since a stop writes what memory
holds to disk too, so do the pool's and the host tier's.

One JSON line: ``bench`` "tier_restart"; ``first`` and ``restarted``: per prompt its seconds
(a non-streamed answer of ``--max-tokens``) and its ``computed`` / ``disk`` / ``host`` /
``local`` tokens; ``restart_disk_share`` (disk-hit tokens after the restart over the prompts'
tokens); ``stop_s`` (SIGINT to exit, first run); ``block_files`` (on disk after the stop);
``outputs_equal``.

    .venv/bin/python bench/tier_restart.py [--model smollm2-135m] [--prompts 6]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from serve_plane import serving  # noqa: E402

from tests.ports import free_port  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def prompt(i: int, words: int) -> str:
    """Prompt ``i``: no block in common with another (its first words differ)."""
    return f"Doc {i}: " + " ".join(
        f"{WORDS[(i * 7 + j * 3) % len(WORDS)]}{j % 13}" for j in range(words)
    )


def ask(
    client: openai.OpenAI, model: str, texts: list[str], max_tokens: int
) -> list[dict[str, Any]]:
    rows = []
    for text in texts:
        start = time.monotonic()
        out = client.completions.create(
            model=model, prompt=text, max_tokens=max_tokens, temperature=0
        )
        k = (out.model_extra or {}).get("kvmesh", {})
        rows.append(
            {
                "s": round(time.monotonic() - start, 3),
                "computed": k.get("computed_tokens"),
                "disk": k.get("disk_hit_tokens"),
                "host": k.get("host_hit_tokens"),
                "local": k.get("local_hit_tokens"),
                "prompt_tokens": out.usage.prompt_tokens if out.usage else None,
                "text": out.choices[0].text,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--words", type=int, default=200, help="words per prompt (~2.5 tokens each)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-cache-memory", default="24MiB")
    p.add_argument("--host-cache-memory", default="16MiB")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="tier_restart-"))
    disk = workdir / "kv"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_TMPDIR", str(workdir))
    cmd = [sys.executable, "-m", "kvmesh.cluster", "serve", "--model", args.model,
           "--workers", "1", "--kv-cache-memory", args.kv_cache_memory,
           "--host-cache-memory", args.host_cache_memory, "--disk-cache-dir", str(disk),
           "--disk-cache-size", "1GiB", "--port", str(port), "--address", "local"]  # fmt: skip
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300
    )
    texts = [prompt(i, args.words) for i in range(args.prompts)]
    row: dict[str, Any] = {"bench": "tier_restart", "model": args.model, "prompts": args.prompts}
    for run in ("first", "restarted"):
        log_path = workdir / f"serve_{run}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True
            )
            try:
                serving(log_path, proc)
                row[run] = ask(client, args.model, texts, args.max_tokens)
            finally:
                sent = time.monotonic()
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if run == "first":
                    row["stop_s"] = round(time.monotonic() - sent, 1)
                    row["block_files"] = len(list(disk.glob("*/slot-*/*/*.kvb")))
    first, again = row["first"], row["restarted"]
    row["outputs_equal"] = [r["text"] for r in first] == [r["text"] for r in again]
    tokens = sum(r["prompt_tokens"] or 0 for r in again)
    row["restart_disk_share"] = round(sum(r["disk"] or 0 for r in again) / max(tokens, 1), 3)
    for r in (*first, *again):
        del r["text"]
    row["workdir"] = str(workdir)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
