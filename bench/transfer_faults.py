"""Transfer faults: pulls that fail, time out or break off, under eviction churn on the holder.

Two worker actors (real Ray, real NIXL by default): a holder with a small pool and a puller
whose transport injects faults (`connector/fault_transport.py`). Rounds run pipelined: the
holder computes round r's prompts while the puller asks for round r-1's, so the holder's new
requests evict the blocks the puller is about to pin (churn), and pins race evictions. A
no-fault reference (an in-process engine, no connector) computes every prompt too.

Checked per round: every request (holder's and puller's) completes and its greedy tokens and
logprobs equal the reference's; and every full prompt block the puller now caches holds the
reference's KV (to float summation order). A block registered from a transfer that did not
finish holds garbage or stale bytes and is counted in ``registered_from_failed``. Late writes
(``late_rate``) are awaited before a round's blocks are checked. Prints one JSON line.

    cd bench && ../.venv/bin/python transfer_faults.py --pulls 1000
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from kvmesh import LLM, SamplingParams
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.connector.transfer_faults import KINDS, TransferFaults
from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.outputs import RequestOutput
from kvmesh.workers.worker_actor import worker_actor_class

# Pulled and computed KV differ by float summation order (~1e-6 here); garbage by ~4, stale
# KV of another prefix by ~1.
KV_ATOL = 1e-3
LOGPROB_ATOL = 1e-3
_run_ids = iter(range(10**9))


def same_output(out: RequestOutput, ref: RequestOutput) -> bool:
    """Same greedy tokens and the same logprobs up to float summation order."""
    if out.token_ids != ref.token_ids:
        return False
    for ours, theirs in zip(out.logprobs or [], ref.logprobs or [], strict=True):
        if ours.keys() != theirs.keys():
            return False
        if any(abs(lp - theirs[tok]) > LOGPROB_ATOL for tok, lp in ours.items()):
            return False
    return True


def reference_blocks(ref: LLM, prompt: Sequence[int], n: int) -> list[np.ndarray] | None:
    """The reference engine's KV bytes of the prompt's first ``n`` full blocks."""
    eng = ref.engine
    hashes = block_hashes(list(prompt), eng.config.block_size, eng.fingerprint.namespace)[:n]
    blocks = [eng.kv.pool.get_cached_block(h) for h in hashes]
    if any(b is None for b in blocks):
        return None
    ids = [b.block_id for b in blocks if b is not None]
    return np.split(eng.kv_cache.export_blocks(ids), len(ids))


def worker_blocks(worker: Any, hashes: list[bytes]) -> list[np.ndarray] | None:
    """A worker's KV bytes of ``hashes`` (pinned and read through its peer API), or None
    when any is no longer cached there."""
    lease = ray.get(worker.pin.remote(hashes, 10.0))
    if lease is None:
        return None
    lease_id, ids = lease
    try:
        return np.split(ray.get(worker.export_blocks.remote(lease_id, ids)), len(ids))
    finally:
        ray.get(worker.release.remote(lease_id))


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` token ids, clear of the first ones (special tokens in real vocabularies)."""
    lo = min(1000, vocab // 4)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def block_diffs(worker: Any, ns: bytes, ref: LLM, prompt: list[int], n: int) -> list[float] | None:
    """Per block of the prompt's first ``n`` full blocks: the largest absolute difference
    between the KV values of the worker (block hash namespace ``ns``) and the reference's
    (inf where not finite); None when either no longer caches them all."""
    eng = ref.engine
    theirs = reference_blocks(ref, prompt, n)
    ours = worker_blocks(worker, block_hashes(prompt, eng.config.block_size, ns)[:n])
    if theirs is None or ours is None:
        return None
    dtype = np.dtype(str(eng.kv_cache.dtype).removeprefix("torch."))
    diffs = []
    for a, b in zip(ours, theirs, strict=True):
        diff = np.abs(a.view(dtype).astype(np.float64) - b.view(dtype).astype(np.float64))
        diffs.append(float(diff.max()) if np.isfinite(diff).all() else float("inf"))
    return diffs


def run_transfer_faults(
    faults: TransferFaults,
    *,
    pulls: int = 1000,
    model: str = "tiny-random",
    transport: str = "nixl",
    block_size: int = 4,
    prompt_blocks: int = 4,
    suffix_tokens: int = 3,
    per_round: int = 6,
    holder_blocks: int = 64,
    puller_blocks: int = 512,
    max_tokens: int = 4,
    timeout_s: float = 1.0,
    seed: int = 0,
    max_rounds: int | None = None,
    holder_options: dict[str, Any] | None = None,
    puller_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run rounds until the puller's transport has seen ``pulls`` reads; the figures as a dict.

    Needs Ray initialized (the caller's). ``holder_options`` / ``puller_options`` go to the
    actors' ``.options()`` (e.g. a custom resource to place them on given hosts).
    """
    started = time.perf_counter()
    engine = EngineConfig(model=model, block_size=block_size, progress=False)
    lease_s = min(30.0, 2 * timeout_s)
    holder_conn = ClusterConnectorConfig(transport=transport, timeout_s=timeout_s, lease_s=lease_s)
    puller_conn = dataclasses.replace(holder_conn, faults=faults)
    cls = worker_actor_class(num_gpus=0, num_cpus=0)
    run = next(_run_ids)
    holder = cls.options(**(holder_options or {})).remote(
        f"tf{run}-holder", dataclasses.replace(engine, num_kv_blocks=holder_blocks), holder_conn, 1
    )
    puller = cls.options(**(puller_options or {})).remote(
        f"tf{run}-puller", dataclasses.replace(engine, num_kv_blocks=puller_blocks), puller_conn, 1
    )
    workers = [holder, puller]
    try:
        info = ray.get([w.ready.remote() for w in workers])
        ref = LLM(**dataclasses.asdict(dataclasses.replace(engine, num_kv_blocks=puller_blocks)))
        rng = random.Random(seed)
        vocab = info[0]["vocab_size"]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
        n_tokens = prompt_blocks * block_size + suffix_tokens
        want: dict[tuple[int, ...], RequestOutput] = {}  # the reference's outputs

        counts = dict.fromkeys(("requests", "failed", "wrong", "checked", "unchecked", "bad"), 0)
        worst_good_diff = 0.0
        holder_prompts: list[list[int]] = []
        pending: list[list[int]] = []  # computed by the holder, not yet asked of the puller
        pulled: list[list[int]] = []  # asked of the puller last round: revisited now
        rounds = 0
        stats = stats_of(puller)
        while stats["fault_reads"] < pulls and (max_rounds is None or rounds < max_rounds):
            rounds += 1
            fresh = [random_tokens(rng, n_tokens, vocab) for _ in range(per_round)]
            # The same prefixes with new suffixes: local hits on the puller's cached blocks,
            # so a bad block registered there is also served.
            revisits = [
                p[: prompt_blocks * block_size] + random_tokens(rng, suffix_tokens, vocab)
                for p in pulled
            ]
            jobs = [(p, holder.generate.remote(p, params)) for p in fresh]
            jobs += [(p, puller.generate.remote(p, params)) for p in pending + revisits]
            # The reference computes each prompt once, in the round the holder does; its pool
            # keeps the last rounds' blocks (LRU) for the check of the puller's.
            asked = fresh + revisits
            want.update(zip(map(tuple, asked), ref.generate(asked, params), strict=True))
            for p, job in jobs:
                counts["requests"] += 1
                try:
                    out = ray.get(job, timeout=120 + 10 * timeout_s)
                except Exception:
                    counts["failed"] += 1
                    continue
                counts["wrong"] += not same_output(out, want[tuple(p)])
            ray.get(holder.flush_events.remote())
            # Late writes of this round land before its blocks are checked.
            deadline = time.monotonic() + 30
            while stats_of(puller)["late_writes_pending"] and time.monotonic() < deadline:
                time.sleep(0.05)
            for p in pending:
                diffs = block_diffs(puller, info[1]["namespace"], ref, p, prompt_blocks)
                if diffs is None:
                    counts["unchecked"] += prompt_blocks
                    continue
                counts["checked"] += len(diffs)
                counts["bad"] += sum(d > KV_ATOL for d in diffs)
                worst_good_diff = max([worst_good_diff, *(d for d in diffs if d <= KV_ATOL)])
            holder_prompts.extend(fresh)
            for p in pulled + revisits:
                del want[tuple(p)]
            pending, pulled = fresh, pending
            stats = stats_of(puller)

        cached = set(ray.get(holder.cached_hashes.remote()))
        hns = info[0]["namespace"]
        prompt_hashes = [h for p in holder_prompts for h in block_hashes(p, block_size, hns)]
        injected = {kind: int(stats[f"injected_{kind}"]) for kind in KINDS}
        return {
            "scenario": "transfer_faults",
            "model": model,
            "transport": transport,
            "requests": counts["requests"],
            "failed": counts["failed"],
            "wrong": counts["wrong"],
            "pulls": int(stats["fault_reads"]),
            "pulls_ok": int(stats["pulls"]),
            "pulled_blocks": int(stats["pulled_blocks"]),
            "pull_failures": int(stats["pull_failures"]),
            "injected": injected,
            # Pulls that failed for want of the blocks (evicted since the lookup) or for real.
            "not_injected_failures": int(stats["pull_failures"]) - sum(injected.values()),
            "holder_evicted_prompt_blocks": sum(h not in cached for h in prompt_hashes),
            "holder_prompt_blocks": len(prompt_hashes),
            "checked_blocks": counts["checked"],
            "unchecked_blocks": counts["unchecked"],
            "registered_from_failed": counts["bad"],
            "max_kv_diff_ok": worst_good_diff,
            "rounds": rounds,
            "faults": dataclasses.asdict(faults),
            "timeout_s": timeout_s,
            "wall_s": round(time.perf_counter() - started, 1),
        }
    finally:
        for w in workers:
            with contextlib.suppress(Exception):  # already dead: nothing to deregister
                ray.get(w.shutdown.remote(), timeout=10)
            ray.kill(w)


def stats_of(worker: Any) -> dict[str, float]:
    return ray.get(worker.connector_stats.remote())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pulls", type=int, default=1000)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--transport", default="nixl", choices=["nixl", "ray"])
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--prompt-blocks", type=int, default=4)
    ap.add_argument("--holder-blocks", type=int, default=64)
    ap.add_argument("--per-round", type=int, default=6)
    ap.add_argument("--puller-blocks", type=int, default=512)
    ap.add_argument("--fail-rate", type=float, default=0.03)
    ap.add_argument("--timeout-rate", type=float, default=0.03)
    ap.add_argument("--partial-rate", type=float, default=0.02)
    ap.add_argument("--late-rate", type=float, default=0.02)
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    faults = TransferFaults(
        fail_rate=args.fail_rate,
        timeout_rate=args.timeout_rate,
        partial_rate=args.partial_rate,
        late_rate=args.late_rate,
        seed=args.seed,
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = run_transfer_faults(
            faults,
            pulls=args.pulls,
            model=args.model,
            transport=args.transport,
            block_size=args.block_size,
            prompt_blocks=args.prompt_blocks,
            holder_blocks=args.holder_blocks,
            per_round=args.per_round,
            puller_blocks=args.puller_blocks,
            timeout_s=args.timeout_s,
            seed=args.seed,
        )
    finally:
        ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
