"""What a peer (any Ray driver on the cluster) may do to a worker and the index, without Ray:
leases as capabilities, pin limits, index tokens, fingerprints that cover the numbers."""

from __future__ import annotations

import ast
import inspect
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh import SamplingParams
from kvmesh.connector import cluster_connector, index_actor, kv_index
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.connector.events import EventBatch, Stored, encode_batch
from kvmesh.connector.kv_index import KvIndex
from kvmesh.workers import worker as worker_module
from kvmesh.workers import worker_actor
from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.peer_leases import MAX_LEASE_S
from kvmesh.workers.worker import Worker

BS = 4
NUM_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    """A worker (no connector, no Ray) holding two cached prompts: 10 blocks of each."""
    cfg = EngineConfig("tiny-random", block_size=BS, num_kv_blocks=NUM_BLOCKS, progress=False)
    w = Worker("w-peer", cfg)
    for seed in (1, 2):
        w.generate([(seed * 37 + i) % 256 for i in range(41)], GREEDY)
    yield w
    w.shutdown()


def hashes_of(w: Worker, seed: int, n: int = 10) -> list[bytes]:
    ids = [(seed * 37 + i) % 256 for i in range(41)]
    return block_hashes(ids, BS, w.engine.fingerprint.namespace)[:n]


# -- 1: export_blocks serves only blocks under the caller's live lease ------------------------


def test_export_blocks_needs_a_live_lease_on_those_blocks(worker: Worker) -> None:
    mine = worker.pin(hashes_of(worker, 1, 6), 5.0)
    other = worker.pin(hashes_of(worker, 2, 6), 5.0)  # another request's lease
    assert mine is not None and other is not None
    (lease, ids), (other_lease, other_ids) = mine, other
    try:
        assert isinstance(lease, str) and len(lease) >= 32  # a secret, not a counter
        assert lease != other_lease
        want = worker.engine.kv_cache.export_blocks(ids).tobytes()
        assert worker.export_blocks(lease, ids).tobytes() == want
        assert worker.export_blocks(lease, ids[2:4]).nbytes > 0  # a subset is fine
        for bad_lease, bad_ids in [
            (lease, other_ids[:1]),  # a block of someone else's lease
            (lease, [ids[0], other_ids[0]]),
            ("0" * 32, ids),  # a guessed id
            (0, ids),  # the old counter ids
            (None, ids),
            (lease, [float(ids[0])]),
        ]:
            with pytest.raises(PermissionError):
                worker.export_blocks(bad_lease, bad_ids)
    finally:
        worker.release(lease)
        worker.release(other_lease)
    with pytest.raises(PermissionError, match="no live lease"):  # released: no bytes
        worker.export_blocks(lease, ids)
    assert worker.num_leases() == 0 and worker.num_pinned() == 0


def test_export_blocks_refuses_an_expired_lease(worker: Worker) -> None:
    got = worker.pin(hashes_of(worker, 1, 2), 0.05)
    assert got is not None
    lease, ids = got
    time.sleep(0.2)  # expired, and (most likely) released by the step thread by now
    with pytest.raises(PermissionError, match="no live lease"):
        worker.export_blocks(lease, ids)
    # Expired but not yet swept: refused all the same.
    lease, ids = worker.pin(hashes_of(worker, 1, 2), 5.0) or ("", [])
    with worker.leases.lock:
        worker.leases.leases[lease].expires_at = time.monotonic() - 1
    with pytest.raises(PermissionError, match="no live lease"):
        worker.export_blocks(lease, ids)
    assert wait_for(lambda: worker.num_leases() == 0)


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- 2: pin limits -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lease_s", [1e9, MAX_LEASE_S + 0.1, math.inf, math.nan, 0, -1.0, True, "5", None]
)
def test_pin_refuses_bad_lease_lengths(worker: Worker, lease_s: object) -> None:
    assert worker.pin(hashes_of(worker, 1), lease_s) is None  # type: ignore[arg-type]
    assert worker.num_leases() == 0 and worker.num_pinned() == 0


def test_pin_caps_the_blocks_pinned_per_call_and_in_total(worker: Worker) -> None:
    free_before = worker.occupancy()["free_blocks"]

    def block_ids(hashes: list[bytes]) -> list[int]:
        return worker.call(lambda: [worker.kv.pool.get_cached_block(h).block_id for h in hashes])

    a = worker.pin(hashes_of(worker, 1), MAX_LEASE_S)  # 10 of 32 blocks: fine
    assert a is not None
    try:
        # 10 more would make 20 > 16 pinned: the lease holds the chain's head that fits.
        c = worker.pin(hashes_of(worker, 2), 5.0)
        assert c is not None and c[1] == block_ids(hashes_of(worker, 2, 6))
        assert worker.num_pinned() == 16
        assert worker.pin(hashes_of(worker, 2)[6:], 5.0) is None  # at the cap: none more
        d = worker.pin(hashes_of(worker, 2), 5.0)  # the same chain again: the same head
        assert d is not None and d[1] == c[1]
        worker.release(d[0])
        assert worker.pin([], 5.0) is None
        # The same blocks again add nothing new: allowed (concurrent pulls of one prefix).
        b = worker.pin(hashes_of(worker, 1), 5.0)
        assert b is not None and b[1] == a[1]
        worker.release(b[0])
        # A peer can never take more than half the pool from this worker's own requests.
        assert worker.num_pinned() == 16
        assert worker.occupancy()["free_blocks"] >= NUM_BLOCKS - worker.leases.max_pinned_blocks
        worker.release(c[0])
    finally:
        worker.release(a[0])
    assert worker.leases.max_pinned_blocks == NUM_BLOCKS // 2
    assert worker.num_pinned() == 0 and worker.occupancy()["free_blocks"] == free_before


def test_connector_config_lease_bounds() -> None:
    default = ClusterConnectorConfig()
    assert default.timeout_s <= default.lease_s <= MAX_LEASE_S
    for kw in [
        {"lease_s": 2.0, "timeout_s": 5.0},  # could expire during the read it protects
        {"lease_s": MAX_LEASE_S * 2},  # holders would refuse every pin
        {"lease_s": math.inf},
        {"lease_s": math.nan},
        {"lease_s": 0.0, "timeout_s": 0.0},
        {"timeout_s": -1.0},
    ]:
        with pytest.raises(ValueError):
            ClusterConnectorConfig(**kw)
    ClusterConnectorConfig(lease_s=5.0, timeout_s=5.0)


# -- 3: no method runs a caller-supplied attribute name ---------------------------------------


@pytest.mark.parametrize("module", [worker_actor, worker_module, cluster_connector, index_actor])
def test_no_call_by_attribute_name(module: object) -> None:
    """getattr/setattr with a name that is not a literal is allowed only in private helpers
    whose callers pass literals (``ClusterKvConnector._call``, config checks)."""
    assert not hasattr(worker_actor.WorkerActor, "connector_call")
    tree = ast.parse(Path(inspect.getfile(module)).read_text())  # type: ignore[arg-type]
    public_dynamic = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "delattr")
                and not isinstance(node.args[1], ast.Constant)
            ):
                public_dynamic.append(f"{fn.name}:{node.lineno}")
    assert public_dynamic == []


# -- 4: index tokens ---------------------------------------------------------------------------


def batch(w: str, seq: int, *hashes: bytes) -> bytes:
    return encode_batch(EventBatch(w, seq, (Stored(hashes),)))


H = [bytes([i]) * 16 for i in range(4)]


def test_index_refuses_calls_for_a_worker_without_its_token() -> None:
    idx = KvIndex("fp")
    token = idx.register("a", "fp", {"node": "n1"})
    assert isinstance(token, str) and len(token) >= 32
    assert "token" not in str(idx.workers())
    # Someone else's batch for "a": rejected, counted, nothing applied.
    for wrong in (None, "", "0" * 32, {"a": "nope"}, {"b": token}):
        result = idx.apply(batch("a", 0, H[0]), wrong)  # type: ignore[arg-type]
        assert result.status == "rejected" and "token" in (result.reason or "")
    assert idx.lookup(H) == {}
    stats = idx.stats()
    assert stats["unauthorized"] == 5 and stats["batches_rejected"] == 5
    assert idx.apply(batch("a", 0, H[0]), token).status == "applied"
    assert idx.apply(batch("a", 1, H[1]), {"a": token}).status == "applied"
    with pytest.raises(PermissionError):
        idx.apply_snapshot("a", [], 5, "forged")
    with pytest.raises(PermissionError):
        idx.deregister("a", None)
    with pytest.raises(PermissionError):  # nobody takes a known worker's name over
        idx.register("a", "fp", {"node": "evil"})
    assert idx.workers() == {"a": {"node": "n1"}} and idx.lookup(H[:2]) == {"a": 2}
    assert idx.stats()["unauthorized"] == 8
    # The worker itself may: re-register (a new token), snapshot, deregister.
    new = idx.register("a", "fp", {"node": "n2"}, token)
    assert new != token
    with pytest.raises(PermissionError):
        idx.apply_snapshot("a", [H[0]], 0, token)  # the old token is dead
    idx.apply_snapshot("a", [H[0]], 0, new)
    assert idx.lookup(H) == {"a": 1}
    assert not idx.deregister("ghost", None) and idx.deregister("a", new)
    assert idx.register("a", "fp") != new  # purged: anyone may register the name again
    idx.check_integrity()


# -- 5: the fingerprint covers what changes KV bytes ------------------------------------------


def test_fingerprint_covers_quantized_matmul_attention_and_device(tmp_path: Path) -> None:
    from kvmesh import LLM
    from kvmesh.workers.cpu_kernels import kernel_library
    from kvmesh.workers.loader import load_weights
    from tests.gguf_helpers import write_gguf

    if kernel_library() is None:
        pytest.skip("the C kernels are not built: quantized matmuls never apply")
    path = write_gguf(load_weights("tiny-random", progress=False), tmp_path / "q.gguf")
    kw = {"block_size": BS, "num_kv_blocks": 16, "progress": False}
    quant = LLM(str(path), **kw).engine
    quant2 = LLM(str(path), **kw).engine
    plain = LLM(str(path), quantized_matmul=False, **kw).engine
    assert quant.num_quantized_weights > 0 and plain.num_quantized_weights == 0
    assert quant.fingerprint.quantized_matmul and not plain.fingerprint.quantized_matmul
    assert quant.fingerprint.id != plain.fingerprint.id
    assert quant.fingerprint.namespace != plain.fingerprint.namespace
    assert quant.fingerprint == quant2.fingerprint  # same config, same fingerprint
    assert quant.fingerprint.device == "cpu"
    assert quant.fingerprint.attention == "TorchAttentionBackend+cpu_kernel.v2"
    assert quant.fingerprint.weights_id == plain.fingerprint.weights_id


def test_fingerprint_namespace_covers_the_new_fields() -> None:
    from dataclasses import replace

    from kvmesh.workers.block_hash import ModelFingerprint

    base = ModelFingerprint("w", "float32", 16, "L2NBHD", 30, 3, 64)
    variants = [
        replace(base, attention="FlashAttentionBackend"),
        replace(base, device="cuda"),
        replace(base, quantized_matmul=True),
        replace(base, rmsnorm="cpu_kernel"),
    ]
    assert len({base.id, *(v.id for v in variants)}) == 5


def test_kv_index_module_has_no_ray() -> None:
    """The token check lives in the plain class, testable without Ray (as the design asks)."""
    assert "import ray" not in Path(inspect.getfile(kv_index)).read_text()
