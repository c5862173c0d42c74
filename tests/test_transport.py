"""Block transports (NIXL and Ray) between real Ray actors in separate processes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import ray
import torch

from kvmesh.connector.nixl_transport import UCX_DEFAULTS, NixlTransport
from kvmesh.connector.ray_transport import RayTransport
from kvmesh.connector.transport import (
    BlockTransport,
    PeerRefused,
    TransferError,
    make_transport,
)
from kvmesh.workers.kv_cache import KVCache
from tests.ray_fixtures import ray_session  # noqa: F401

TRANSPORTS = ["nixl", "ray"]
FP = "fp-smol"


def tiny_cache(num_blocks: int, head_dim: int = 8, seed: int | None = None) -> KVCache:
    """2 layers, 2 KV heads, block_size 4; random content when seeded, else zeros."""
    shape = (2, 2, num_blocks, 4, 2, head_dim)
    if seed is None:
        return KVCache(torch.zeros(shape))
    return KVCache(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


@ray.remote(num_cpus=0)
class Node:
    """A stand-in worker actor: a KV cache, its transport and `export_blocks`."""

    def __init__(self, transport: str, worker_id: str, num_blocks: int, seed: int) -> None:
        self.transport = make_transport(transport, worker_id, tiny_cache(num_blocks, seed=seed), FP)

    def info(self) -> bytes:
        return self.transport.local_info()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def snapshot(self) -> np.ndarray:
        return self.transport.kv_cache.data.numpy().copy()

    def add_peer(self, info: bytes, handle: Any) -> str:
        return self.transport.add_peer(info, handle)

    def read(self, peer: str, remote: Sequence[int], local: Sequence[int], timeout: float) -> int:
        return self.transport.read_blocks(peer, remote, local, timeout, "lease-of-" + peer)

    def export_blocks(self, lease_id: str, block_ids: Sequence[int]) -> np.ndarray:
        # A worker actor serves only blocks under the caller's live lease (test_peer_hardening);
        # this stand-in checks that the puller passed the lease it holds along.
        if lease_id != "lease-of-" + self.transport.worker_id:
            raise PermissionError(f"no live lease {lease_id!r}")
        return self.transport.export_blocks(block_ids)


@pytest.fixture(scope="module", params=TRANSPORTS)
def pair(request: pytest.FixtureRequest, ray_session: None) -> Iterator[tuple[Any, Any, str]]:  # noqa: F811
    """(holder with 16 random blocks, puller with 12 other random blocks, holder id), peered."""
    name = request.param
    holder = Node.remote(name, f"holder-{name}", 16, seed=1)
    puller = Node.remote(name, f"puller-{name}", 12, seed=2)
    peer_id = ray.get(puller.add_peer.remote(ray.get(holder.info.remote()), holder))
    yield holder, puller, peer_id
    for actor in (holder, puller):
        ray.kill(actor)


def test_pull_copies_exact_bytes_and_nothing_else(pair: tuple[Any, Any, str]) -> None:
    holder, puller, peer_id = pair
    remote = [3, 7, 8, 9, 15, 0]  # a run (7, 8, 9) and scattered ids
    local = [10, 2, 3, 4, 0, 11]
    src, before = ray.get([holder.snapshot.remote(), puller.snapshot.remote()])
    moved = ray.get(puller.read.remote(peer_id, remote, local, 10.0))
    after = ray.get(puller.snapshot.remote())
    assert moved == len(remote) * src[:, :, 0].nbytes
    for r, loc in zip(remote, local, strict=True):
        assert after[:, :, loc].tobytes() == src[:, :, r].tobytes()
    untouched = [b for b in range(12) if b not in local]
    assert after[:, :, untouched].tobytes() == before[:, :, untouched].tobytes()
    assert ray.get(puller.read.remote(peer_id, [], [], 10.0)) == 0


def test_add_peer_is_idempotent(pair: tuple[Any, Any, str]) -> None:
    holder, puller, peer_id = pair
    info = ray.get(holder.info.remote())
    assert ray.get(puller.add_peer.remote(info, holder)) == peer_id
    assert ray.get(puller.read.remote(peer_id, [5], [6], 10.0)) > 0


@pytest.mark.parametrize(
    ("remote", "local", "match"),
    [([16], [0], "out of range"), ([0], [12], "out of range"), ([-1], [0], "out of range"),
     ([0, 1], [0], "remote block ids"), ([0, 1], [5, 5], "repeated")],
)  # fmt: skip
def test_bad_block_ids_raise(
    pair: tuple[Any, Any, str], remote: list[int], local: list[int], match: str
) -> None:
    _, puller, peer_id = pair
    with pytest.raises(TransferError, match=match):
        ray.get(puller.read.remote(peer_id, remote, local, 10.0))


def test_unknown_peer_raises(pair: tuple[Any, Any, str]) -> None:
    _, puller, _ = pair
    with pytest.raises(TransferError, match="unknown peer"):
        ray.get(puller.read.remote("nobody", [0], [0], 10.0))


@pytest.mark.parametrize("name", TRANSPORTS)
def test_dead_holder_raises_within_timeout(name: str, ray_session: None) -> None:  # noqa: F811
    holder = Node.remote(name, f"doomed-{name}", 16, seed=3)
    puller = Node.remote(name, f"survivor-{name}", 16, seed=4)
    peer_id = ray.get(puller.add_peer.remote(ray.get(holder.info.remote()), holder))
    ray.kill(holder)
    time.sleep(0.5)  # let the process go
    t = time.monotonic()
    with pytest.raises(TransferError):
        ray.get(puller.read.remote(peer_id, [1, 2], [1, 2], 5.0), timeout=30)
    assert time.monotonic() - t < 10
    ray.kill(puller)


@pytest.mark.parametrize("cls", [NixlTransport, RayTransport])
def test_add_peer_refuses_other_fingerprint_or_layout(cls: type[BlockTransport]) -> None:
    ours = cls("w-ours", tiny_cache(8), FP)
    other_fp = cls("w-other-fp", tiny_cache(8), "fp-other")
    other_layout = cls("w-other-layout", tiny_cache(8, head_dim=4), FP)
    with pytest.raises(PeerRefused, match=r"fp-other.*fp-smol"):
        ours.add_peer(other_fp.local_info(), handle=object())
    with pytest.raises(PeerRefused, match=r"w-other-layout.*w-ours"):
        ours.add_peer(other_layout.local_info(), handle=object())
    for t in (ours, other_fp, other_layout):
        t.close()


def test_add_peer_refuses_other_transport() -> None:
    nixl, via_ray = (
        NixlTransport("w-nixl", tiny_cache(8), FP),
        RayTransport("w-ray", tiny_cache(8), FP),
    )
    with pytest.raises(PeerRefused, match="transport"):
        nixl.add_peer(via_ray.local_info())
    nixl.close()


def test_nixl_between_two_agents_in_one_process() -> None:
    holder = NixlTransport("local-holder", tiny_cache(16, seed=5), FP)
    puller = NixlTransport("local-puller", tiny_cache(16), FP)
    peer_id = puller.add_peer(holder.local_info())
    assert puller.read_blocks(peer_id, [0, 1, 2, 9], [4, 5, 6, 1], 10.0) > 0
    src, dst = holder.kv_cache.data, puller.kv_cache.data
    assert torch.equal(dst[:, :, [4, 5, 6, 1]], src[:, :, [0, 1, 2, 9]])
    assert not dst[:, :, [0, 2, 3, 7]].any()
    puller.remove_peer(peer_id)
    with pytest.raises(TransferError, match="unknown peer"):
        puller.read_blocks(peer_id, [0], [0], 10.0)
    puller.close()
    holder.close()


def test_nixl_huge_pages_keep_the_content() -> None:
    cache = KVCache(torch.randn(2, 2, 64, 16, 4, 64))  # 4 MiB: at least one whole huge page
    before = cache.data.clone()
    t = NixlTransport("w-huge", cache, FP)
    assert torch.equal(cache.data, before)
    t.close()


def test_export_blocks_matches_read_block() -> None:
    t = RayTransport("w-export", tiny_cache(8, seed=6), FP)
    out = t.export_blocks([5, 2])
    assert out.dtype == np.uint8
    assert out.tobytes() == t.kv_cache.read_block(5) + t.kv_cache.read_block(2)


def test_ray_transport_rejects_wrong_size(ray_session: None) -> None:  # noqa: F811
    class ShortHandle:  # an "actor handle" whose export_blocks returns too few bytes
        class export_blocks:
            @staticmethod
            def remote(lease_id: str | None, ids: list[int]) -> ray.ObjectRef:
                return ray.put(np.zeros(5, dtype=np.uint8))

    holder, puller = RayTransport("w-h", tiny_cache(8), FP), RayTransport("w-p", tiny_cache(8), FP)
    peer_id = puller.add_peer(holder.local_info(), ShortHandle())
    with pytest.raises(TransferError, match="sent 5 bytes"):
        puller.read_blocks(peer_id, [0], [0], 10.0)


def test_ray_transport_times_out(ray_session: None) -> None:  # noqa: F811
    @ray.remote(num_cpus=0)
    def never_done() -> None:
        time.sleep(5)

    class SlowHandle:  # an "actor handle" whose export_blocks does not answer in time
        class export_blocks:
            @staticmethod
            def remote(lease_id: str | None, ids: list[int]) -> ray.ObjectRef:
                return never_done.remote()

    holder, puller = (
        RayTransport("w-h2", tiny_cache(8), FP),
        RayTransport("w-p2", tiny_cache(8), FP),
    )
    peer_id = puller.add_peer(holder.local_info(), SlowHandle())
    t = time.monotonic()
    with pytest.raises(TransferError, match="timed out"):
        puller.read_blocks(peer_id, [0], [0], 0.5)
    assert time.monotonic() - t < 3


def test_make_transport_picks_by_name() -> None:
    cache = tiny_cache(4)
    assert isinstance(make_transport("ray", "w-r", cache, FP), RayTransport)
    auto = make_transport(None, "w-auto", cache, FP)
    assert isinstance(auto, NixlTransport)  # nixl is installed here
    auto.close()
    with pytest.raises(ValueError, match="unknown transport"):
        make_transport("carrier-pigeon", "w-x", cache, FP)


def test_ray_transport_passes_the_lease_to_the_holder(ray_session: None) -> None:  # noqa: F811
    seen = []

    class Holder:  # an "actor handle" that records what export_blocks was called with
        class export_blocks:
            @staticmethod
            def remote(lease_id: str | None, ids: list[int]) -> ray.ObjectRef:
                seen.append((lease_id, ids))
                return ray.put(holder.export_blocks(ids))

    holder = RayTransport("w-h3", tiny_cache(8, seed=7), FP)
    puller = RayTransport("w-p3", tiny_cache(8), FP)
    peer_id = puller.add_peer(holder.local_info(), Holder())
    assert puller.read_blocks(peer_id, [3, 1], [0, 5], 10.0, "the-lease") > 0
    assert seen == [("the-lease", [3, 1])]
    assert torch.equal(puller.kv_cache.data[:, :, [0, 5]], holder.kv_cache.data[:, :, [3, 1]])


def test_nixl_sets_ucx_tcp_segments_unless_the_environment_does(ray_session: None) -> None:  # noqa: F811
    """``UCX_DEFAULTS`` (64 KiB TCP segments: a slab in one message) are in a worker's
    environment when its agent starts; a value the operator set stays."""
    plain = Node.remote("nixl", "w-seg-default", 4, seed=0)
    own = {"UCX_TCP_TX_SEG_SIZE": "16k"}
    tuned = Node.options(runtime_env={"env_vars": own}).remote("nixl", "w-seg-own", 4, seed=0)
    try:
        for name, value in UCX_DEFAULTS.items():
            assert ray.get(plain.env.remote(name)) == value
        assert ray.get(tuned.env.remote("UCX_TCP_TX_SEG_SIZE")) == "16k"
        assert (
            ray.get(tuned.env.remote("UCX_TCP_RX_SEG_SIZE")) == UCX_DEFAULTS["UCX_TCP_RX_SEG_SIZE"]
        )
    finally:
        for node in (plain, tuned):
            ray.kill(node)
