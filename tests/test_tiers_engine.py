"""An engine with host and disk tiers: its outputs equal the no-tier reference after its
blocks went down and back, through a restart, a corrupt file, a pin, and the API's metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvmesh.workers.block_hash import BlockHash, block_hashes
from kvmesh.workers.kv_connector import NoopKvCacheConnector
from kvmesh.workers.llm import LLM
from kvmesh.workers.peer_leases import PeerLeases, ToStage
from kvmesh.workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)
# Six 160-token prompts that share nothing: in a 24-block pool each evicts the one before.
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(160)] for i in range(6)]


# -- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("tiny-random", num_kv_blocks=24, progress=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


class Announced(NoopKvCacheConnector):
    """Records what the tiers tell a connector (the cluster connector tells the index)."""

    def __init__(self) -> None:
        self.held: dict[str, set[BlockHash]] = {"host": set(), "disk": set()}

    def on_tier_store(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        self.held[medium] |= set(hashes)

    def on_tier_remove(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        self.held[medium] -= set(hashes)


class Ordered(NoopKvCacheConnector):
    """Records the order in which the pool's losses and the tiers' gains are heard."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, BlockHash]] = []

    def on_evict(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self.heard += [("evicted", h) for h in hashes]

    def on_tier_store(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        self.heard += [(medium, h) for h in hashes]


def churn(llm: LLM, reference: list[list[int]], n: int = len(PROMPTS)) -> None:
    """The first ``n`` prompts, each alone, so each evicts the ones before (down into the
    tiers)."""
    for p, want in zip(PROMPTS[:n], reference[:n], strict=True):
        assert llm.generate([p], GREEDY)[0].token_ids == want


def test_outputs_equal_after_blocks_went_to_disk_and_came_back(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    kw = {"host_cache_memory": 20 * 8192, "disk_cache_dir": str(tmp_path)}
    llm = LLM("tiny-random", num_kv_blocks=24, progress=False, **kw)
    churn(llm, reference)
    time.sleep(0.2)  # the writer
    outs = llm.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == reference[:3]
    m = [o.metrics for o in outs]
    assert sum(x.num_disk_hit_tokens for x in m) > 0, m
    for x, p in zip(m, PROMPTS, strict=False):
        total = x.num_local_hit_tokens + x.num_host_hit_tokens + x.num_disk_hit_tokens
        assert total + x.num_computed_tokens == len(p)
    stats = llm.engine.kv.connector.get_stats()
    assert stats["disk_loaded_blocks"] > 0 and stats["disk_corrupt_blocks"] == 0
    llm.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_tier_copy_is_announced_before_the_pools_loss(
    tier: str, tmp_path: Path, reference: list[list[int]]
) -> None:
    """Whoever mirrors the worker (the index) never sees an evicted block held nowhere: the
    tier's store comes first (before: the pool's loss first, and a router in between saw
    neither)."""
    kw = (
        {"host_cache_memory": "4MiB"}
        if tier == "host"
        else {"disk_cache_dir": str(tmp_path), "disk_cache_size": "16MiB"}
    )
    heard = Ordered()
    llm = LLM("tiny-random", num_kv_blocks=24, progress=False, connector=heard, **kw)
    churn(llm, reference)
    evicted = {h for what, h in heard.heard if what == "evicted"}
    assert evicted
    first: dict[BlockHash, str] = {}
    for what, h in heard.heard:
        first.setdefault(h, what)
    # Blocks being written count as host blocks: a disk-only tier announces them so too.
    assert {first[h] for h in evicted} == {"host"}
    llm.close()


def test_a_restarted_worker_announces_its_disk_blocks_and_serves_them(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    kw = {"disk_cache_dir": str(tmp_path), "disk_cache_size": "16MiB"}
    first = LLM("tiny-random", num_kv_blocks=24, progress=False, **kw)
    churn(first, reference)
    first.close()  # finishes the queued writes
    on_disk = {bytes.fromhex(p.stem) for p in tmp_path.glob("*/slot-0/*/*.kvb")}
    assert on_disk

    inner = Announced()
    second = LLM("tiny-random", num_kv_blocks=24, progress=False, connector=inner, **kw)
    assert inner.held["disk"] == on_disk
    out = second.generate(PROMPTS[:1], GREEDY)[0]
    assert out.token_ids == reference[0]
    assert out.metrics.num_disk_hit_tokens == 144  # all 9 full blocks but the last token's
    second.close()


def test_a_stopped_worker_keeps_its_pool_for_the_next_start(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    """Three prompts, the pool (24 blocks) holding the last two and the host tier the first:
    closed and started again, every one loads from disk. Before, only evicted blocks reached
    disk, and after a restart the prompts that never left the pool were computed again."""
    kw = {"disk_cache_dir": str(tmp_path), "disk_cache_size": "16MiB"}
    first = LLM("tiny-random", num_kv_blocks=24, host_cache_memory=12 * 8192, progress=False, **kw)
    churn(first, reference, 3)
    first.close()
    second = LLM("tiny-random", num_kv_blocks=24, progress=False, **kw)
    outs = second.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == reference[:3]
    assert [o.metrics.num_disk_hit_tokens for o in outs] == [144] * 3  # 9 blocks each
    second.close()


def test_a_pin_promotes_tier_blocks_into_the_pool_disk_ones_once_staged(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    """A peer pins a prompt the pool evicted: from host memory it comes back into fresh pool
    blocks (their bytes the tier's, registered, held by the lease); a prompt only on disk is
    refused with nothing taken until its files are staged (read off the step thread), then
    promoted the same way, all or nothing."""
    kw = {"host_cache_memory": 12 * 8192, "disk_cache_dir": str(tmp_path)}
    llm = LLM("tiny-random", num_kv_blocks=24, progress=False, **kw)
    churn(llm, reference)
    kv, tiers = llm.engine.kv, llm.engine.kv.connector.tiers
    tiers.wait_written()
    ns = llm.engine.fingerprint.namespace

    def chain(p: list[int]) -> list[BlockHash]:
        return block_hashes(p, 16, ns)[:9]

    def media(p: list[int]) -> set[str | None]:
        """Where each block of p's chain is: a tier's name, or "pool"."""
        return {"pool" if kv.pool.get_cached_block(x) else tiers.medium(x) for x in chain(p)}

    # The pool evicts a chain's tail first, so a prompt is partly in the pool, partly in host.
    in_host = next(p for p in PROMPTS if "host" in media(p) and media(p) <= {"pool", "host"})
    on_disk = next(p for p in PROMPTS if media(p) == {"disk"})
    free = kv.num_free_blocks
    assert kv.pins.pin("on-disk", chain(on_disk)) is None  # disk blocks need their bytes staged
    assert kv.num_free_blocks == free and not kv.pins
    kv.check_integrity()

    promoted = {x: tiers.read(x) for x in chain(in_host) if tiers.medium(x) == "host"}
    ids = kv.pins.pin("lease", chain(in_host))
    assert ids is not None and len(ids) == 9
    for x, block_id in zip(chain(in_host), ids, strict=True):
        assert kv.pool.get_cached_block(x).block_id == block_id
        if x in promoted:
            assert llm.engine.kv_cache.read_block(block_id) == promoted[x]
    assert llm.engine.kv.connector.get_stats()["promoted_blocks"] == len(promoted) > 0
    kv.check_integrity()  # the lease's references counted
    kv.pins.unpin("lease")
    kv.check_integrity()
    out = llm.generate([in_host], GREEDY)[0]  # a local hit on the promoted blocks now
    assert out.token_ids == reference[PROMPTS.index(in_host)]
    assert out.metrics.num_local_hit_tokens == 144

    # Staged (read off the step thread, checked), the disk copies are promoted too.
    assert media(on_disk) == {"disk"}
    assert kv.pins.to_stage(chain(on_disk), {}) == chain(on_disk)
    staged = kv.connector.stage(chain(on_disk))
    assert kv.pins.to_stage(chain(on_disk), staged) == []
    torn = dict(staged)
    del torn[chain(on_disk)[4]]  # a file that failed its check while staged: all or nothing
    assert kv.pins.pin("on-disk", chain(on_disk), torn) is None and not kv.pins
    ids = kv.pins.pin("on-disk", chain(on_disk), staged)
    assert ids is not None and len(ids) == 9
    for x, block_id in zip(chain(on_disk), ids, strict=True):
        assert llm.engine.kv_cache.read_block(block_id) == staged[x] == tiers.read(x)
    kv.check_integrity()
    kv.pins.unpin("on-disk")
    stats = llm.engine.kv.connector.get_stats()
    assert stats["promoted_blocks"] == len(promoted) + 9 and stats["promote_s"] > 0
    llm.close()


def test_a_pin_fills_a_hole_in_the_pool_from_the_tiers(reference: list[list[int]]) -> None:
    """A chain whose middle block left the pool (into host memory) while the rest stayed: the
    pin promotes just that block and holds the chain in order (before: refused, and the peer
    computed everything past the hole)."""
    llm = LLM("tiny-random", num_kv_blocks=24, progress=False, host_cache_memory=12 * 8192)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == reference[0]
    kv, tiers = llm.engine.kv, llm.engine.kv.connector.tiers
    chain = block_hashes(PROMPTS[0], 16, llm.engine.fingerprint.namespace)[:9]
    middle = kv.pool.get_cached_block(chain[4])
    kv.pool.touch([middle])
    kv.pool.free_blocks([middle], front=True)  # the next allocation evicts it, and only it
    kv.pool.free_blocks(kv.pool.get_new_blocks(1))
    assert kv.pool.get_cached_block(chain[4]) is None and tiers.medium(chain[4]) == "host"
    assert all(kv.pool.get_cached_block(h) for h in chain[:4] + chain[5:])
    assert kv.pins.pin("twice", [chain[4], chain[4]]) is None and not kv.pins  # not a chain
    ids = kv.pins.pin("lease", chain)
    assert ids is not None and len(ids) == 9
    assert [kv.pool.get_cached_block(h).block_id for h in chain] == ids
    assert llm.engine.kv.connector.get_stats()["promoted_blocks"] == 1
    kv.check_integrity()
    kv.pins.unpin("lease")
    kv.check_integrity()
    llm.close()


def test_a_pin_without_room_for_every_promotion_holds_the_prefix_that_fits(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    """A peer asks for a chain while the pool has room for only part of it: each block the
    pin holds takes one free block (a free cached one leaves the queue, a missing one is
    promoted into one), so the lease holds the chain's first ``room`` blocks, and only their
    disk copies are staged. Before, the pin was refused whole and the peer computed it all
    (a tier soak saw 52 of 54 pulls fail so)."""
    kw = {"host_cache_memory": 12 * 8192, "disk_cache_dir": str(tmp_path)}
    llm = LLM("tiny-random", num_kv_blocks=24, progress=False, **kw)
    churn(llm, reference)
    kv, tiers = llm.engine.kv, llm.engine.kv.connector.tiers
    tiers.wait_written()
    leases = PeerLeases("w", kv, llm.engine.kv_cache)
    ns = llm.engine.fingerprint.namespace
    room = 5
    busy = kv.pool.get_new_blocks(kv.num_free_blocks - room)  # as running requests would hold
    tiers.wait_written()

    def media(chain: list[BlockHash]) -> list[str | None]:
        return ["pool" if kv.pool.get_cached_block(x) else tiers.medium(x) for x in chain]

    chains = [block_hashes(p, 16, ns)[:9] for p in PROMPTS]
    in_host = next(c for c in chains if "host" in media(c) and set(media(c)) <= {"pool", "host"})
    on_disk = next(c for c in chains if set(media(c)) == {"disk"})
    expect = {x: tiers.read(x) for x in in_host if tiers.medium(x) == "host"}
    lease_id, ids = leases.grant(in_host, 5.0, None)
    assert [kv.pool.get_cached_block(x).block_id for x in in_host[:room]] == ids
    for x, block_id in zip(in_host, ids, strict=False):
        if x in expect:
            assert llm.engine.kv_cache.read_block(block_id) == expect[x]
    assert kv.num_free_blocks == 0 and kv.pins.num_refs == room
    leases.release(lease_id)

    staging = leases.grant(on_disk, 5.0, None)  # only the blocks that fit are read
    assert isinstance(staging, ToStage) and staging.hashes == tuple(on_disk[:room])
    staged = kv.connector.stage(staging.hashes)
    del staged[on_disk[3]]  # its file failed the check: the lease stops before it
    lease_id, ids = leases.grant(on_disk, 5.0, staged)
    assert [kv.pool.get_cached_block(x).block_id for x in on_disk[:3]] == ids
    for x, block_id in zip(on_disk, ids, strict=False):
        assert llm.engine.kv_cache.read_block(block_id) == staged[x]
    leases.release(lease_id)
    kv.pool.free_blocks(busy)
    kv.check_integrity()  # the pins' and the test's references all given back
    llm.close()


def test_corrupt_disk_blocks_are_computed(tmp_path: Path, reference: list[list[int]]) -> None:
    kw = {"disk_cache_dir": str(tmp_path), "disk_cache_size": "16MiB"}
    first = LLM("tiny-random", num_kv_blocks=24, progress=False, **kw)
    churn(first, reference)
    fingerprint = first.engine.fingerprint
    first.close()
    hashes = block_hashes(PROMPTS[0], 16, fingerprint.namespace)
    path = next(tmp_path.glob(f"*/slot-0/*/{hashes[0].hex()}.kvb"))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # a flipped bit in the first block: the header still reads well
    path.write_bytes(bytes(data))
    second = LLM("tiny-random", num_kv_blocks=24, progress=False, **kw)
    out = second.generate(PROMPTS[:1], GREEDY)[0]
    assert out.token_ids == reference[0]
    assert out.metrics.num_disk_hit_tokens == 0 and out.metrics.num_computed_tokens == 160
    # The first block stops the load (the blocks read ahead of it are whole, and unused).
    assert second.engine.kv.connector.get_stats()["disk_corrupt_blocks"] == 1
    assert not path.exists()
    again = second.generate(PROMPTS[1:2], GREEDY)[0]  # its blocks are all whole
    assert again.token_ids == reference[1] and again.metrics.num_disk_hit_tokens == 144
    second.close()


def test_the_api_reports_tier_hits_and_metrics(tmp_path: Path) -> None:
    import openai

    from kvmesh.cluster.local_backend import LocalBackend
    from kvmesh.cluster.openai_api import build_api
    from tests.openai_helpers import call, check_kvmesh, serve

    backend = LocalBackend(
        model="tiny-random", num_kv_blocks=24, disk_cache_dir=str(tmp_path), progress=False
    )
    texts = [
        chr(97 + i) * 40 + "".join(chr(65 + (j * (i + 3)) % 26) for j in range(120))
        for i in range(6)
    ]
    try:
        with serve(build_api(backend, model_name="tiny-random")) as port:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            first = None
            for text in texts:  # each evicts the one before: down to the disk tier
                r = client.completions.create(
                    model="tiny-random", prompt=text, max_tokens=4, temperature=0
                )
                first = first or r
            assert backend.worker.kv.connector.tiers.wait_written()
            again = client.completions.create(
                model="tiny-random", prompt=texts[0], max_tokens=4, temperature=0
            )
            assert again.choices[0].text == first.choices[0].text
            kv = again.model_extra["kvmesh"]
            check_kvmesh(kv, again.usage)
            assert kv["disk_hit_tokens"] >= 128 and kv["local_hit_tokens"] == 0
            status, body = call(port, "GET", "/metrics")
            assert status == 200
            assert 'kvmesh_prompt_tokens_total{source="disk_hit"}' in body
            loaded = [
                line
                for line in body.splitlines()
                if line.startswith('kvmesh_tier_loaded_blocks_total{medium="disk"}')
            ]
            assert loaded and float(loaded[0].split()[-1]) >= 8, loaded
            for counter in ("disk_writes_dropped", "disk_evicted_blocks", "tier_promoted_blocks"):
                assert f"kvmesh_{counter}_total 0.0" in body, counter  # none here, but shown
    finally:
        backend.shutdown()


def test_a_load_from_the_host_tier_is_not_pushed_out_by_its_own_allocation(
    reference: list[list[int]],
) -> None:
    """Three prompts through a pool that holds one and a host tier that holds two: the first
    comes back from the host tier whole. Its lookup marks its host blocks used, so the
    demotions its own allocation causes evict the other prompt's. Before, they evicted its
    own oldest blocks and it loaded none of its 9 (seen live: a 534-token prompt got 400
    tokens from host memory and computed 134)."""
    llm = LLM("tiny-random", num_kv_blocks=12, progress=False, host_cache_memory=20 * 8192)
    churn(llm, reference, 3)
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.token_ids == reference[0]
    assert out.metrics.num_host_hit_tokens == 144  # all 9 full blocks but the last token's
    llm.close()


def test_a_load_from_both_tiers_reports_each_tiers_share(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    """A prompt whose head is in host memory and whose tail went on to disk: the response
    splits its hits by where each block came from. Before, the whole load counted under its
    slowest medium (all 144 tokens "disk" although 96 came from memory)."""
    kw = {"host_cache_memory": 15 * 8192, "disk_cache_dir": str(tmp_path)}
    llm = LLM("tiny-random", num_kv_blocks=12, progress=False, **kw)
    churn(llm, reference, 3)
    tiers = llm.engine.kv.connector.tiers
    assert tiers.wait_written()
    chain = block_hashes(PROMPTS[0], 16, llm.engine.fingerprint.namespace)[:9]
    media = [tiers.medium(x) for x in chain]
    assert media.count("host") and media.count("disk") and None not in media
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.token_ids == reference[0]
    m = out.metrics
    assert (m.num_host_hit_tokens, m.num_disk_hit_tokens) == (
        16 * media.count("host"),
        16 * media.count("disk"),
    )
    llm.close()
