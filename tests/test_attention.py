"""Paged attention backends vs a dense causal reference computed without any cache, plus the
metadata builder and the paged KV cache's layout and byte copies."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest
import torch

from kvmesh.workers import cascade_attention
from kvmesh.workers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    get_attn_backend,
)
from kvmesh.workers.cascade_attention import find_shared_prefix
from kvmesh.workers.cpu_kernels import kernel_library
from kvmesh.workers.flash_attention import FlashAttentionBackend
from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.memory_size import parse_memory
from kvmesh.workers.model_config import ModelConfig

D = 16


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq positions of a context whose full K/V is k, v [S, Hkv, D]."""
    lq, hq, _ = q.shape
    s, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [Hq, Lq, S]
    qpos = torch.arange(s - lq, s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [Lq, Hq, D]


def make_case(
    backend: AttentionBackend,
    query_lens: list[int],
    seq_lens: list[int],
    hq: int,
    hkv: int,
    block_size: int = 4,
    num_blocks: int = 64,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shared_blocks: int = 0,
    sharing: list[int] | None = None,
    head_dim: int = D,
    kv_dtype: torch.dtype | None = None,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step of a mixed batch with cached prefixes pre-written: (backend output, dense
    reference [T, Hq, D] float64, the step's metadata). Rows in `sharing` (default: all) start
    with the same `shared_blocks` block ids holding the same K/V, as after a prefix-cache hit.
    K/V values are rounded to `kv_dtype` (default `dtype`) and held in a cache of
    `cache_dtype` (default `kv_dtype`)."""
    kv_dtype = kv_dtype or dtype
    cache_dtype = cache_dtype or kv_dtype

    def kv_values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(kv_dtype).to(dtype)

    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ids = list(range(1, num_blocks))  # block 0 stays unused, as the padding id
    rng.shuffle(ids)
    common = [ids.pop() for _ in range(shared_blocks)]
    sharing = list(range(len(seq_lens))) if sharing is None else sharing
    shared_k = kv_values(shared_blocks * block_size, hkv, head_dim)
    shared_v = kv_values(shared_blocks * block_size, hkv, head_dim)
    tables = []
    for b, s in enumerate(seq_lens):  # random, non-contiguous block ids per sequence
        n = -(-s // block_size)
        head = common if b in sharing else []
        tables.append(head + [ids.pop() for _ in range(n - len(head))])
    # Garbage everywhere else: padding entries and unused slots must be masked, not just zero.
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen)
    k_cache, v_cache = (c.to(device, cache_dtype) for c in (k_cache, v_cache))
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    qs, ks, vs, refs = [], [], [], []
    scale = head_dim**-0.5
    for b, (lq, s, table) in enumerate(zip(query_lens, seq_lens, tables, strict=True)):
        q = torch.randn(lq, hq, head_dim, generator=gen).to(dtype)
        k = kv_values(s, hkv, head_dim)
        v = kv_values(s, hkv, head_dim)
        if b in sharing:
            k[: len(shared_k)], v[: len(shared_v)] = shared_k, shared_v
        for p in range(s - lq):  # the cached prefix, written by "earlier steps"
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        refs.append(dense_reference(q, k, v, scale))
        qs.append(q)
        ks.append(k[s - lq :])
        vs.append(v[s - lq :])
    out = backend.forward(
        torch.cat(qs).to(device),
        torch.cat(ks).to(device),
        torch.cat(vs).to(device),
        k_cache,
        v_cache,
        meta,
        scale,
    )
    assert out.shape == (sum(query_lens), hq, head_dim) and out.dtype == dtype
    new_k = torch.cat(ks).to(device)
    flat = k_cache.view(-1, hkv, head_dim)
    assert torch.equal(flat[meta.slot_mapping].to(dtype), new_k), "new K not at slot_mapping"
    return out, torch.cat(refs), meta


def run_case(*args: Any, **kwargs: Any) -> float:
    """make_case's max abs error against the dense reference."""
    out, ref, _ = make_case(*args, **kwargs)
    return (out.double().cpu() - ref).abs().max().item()


HEADS = [(4, 4), (4, 2), (8, 1)]
needs_kernels = pytest.mark.skipif(kernel_library() is None, reason="no C compiler here")
# The torch backend on its own, and with the CPU kernel taking the short rows.
BACKENDS = [
    pytest.param(False, id="torch"),
    pytest.param(True, id="cpu-kernel", marks=needs_kernels),
]


@pytest.mark.parametrize("kernel", BACKENDS)
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_mixed_batch_prefills_with_prefix_and_decodes(hq: int, hkv: int, kernel: bool) -> None:
    # Order mixes kinds: prefix prefill, decode, fresh prefill, decode, prefix prefill across
    # blocks, single-token prompt (a decode-shaped row).
    backend = TorchAttentionBackend(cpu_kernel=kernel)
    err = run_case(backend, [5, 1, 9, 1, 6, 1], [12, 7, 9, 17, 6 + 11, 1], hq, hkv)
    assert err < 1e-5, f"max abs diff {err}"


@pytest.mark.parametrize("kernel", BACKENDS)
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_pure_decodes(hq: int, hkv: int, kernel: bool) -> None:
    err = run_case(TorchAttentionBackend(cpu_kernel=kernel), [1] * 5, [3, 16, 1, 9, 30], hq, hkv)
    assert err < 1e-5, f"max abs diff {err}"


@pytest.mark.parametrize("kernel", BACKENDS)
def test_pure_fresh_prefills(kernel: bool) -> None:
    err = run_case(TorchAttentionBackend(cpu_kernel=kernel), [7, 13, 2], [7, 13, 2], 4, 2)
    assert err < 1e-5, f"max abs diff {err}"


@pytest.mark.parametrize("kernel", BACKENDS)
def test_chunked_prefill_in_two_steps(kernel: bool) -> None:
    """A 13-token prompt as chunks of 7 then 6 through the cache equals one dense pass."""
    backend, hq, hkv, bs = TorchAttentionBackend(cpu_kernel=kernel), 4, 2, 4
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(13, h, D, generator=gen) for h in (hq, hkv, hkv))
    table = [9, 2, 14, 5]
    k_cache, v_cache = torch.randn(16, bs, hkv, D), torch.randn(16, bs, hkv, D)
    outs = []
    for lo, hi in ((0, 7), (7, 13)):
        meta = AttentionMetadata.build([hi - lo], [hi], [table], bs, "cpu")
        outs.append(backend.forward(q[lo:hi], k[lo:hi], v[lo:hi], k_cache, v_cache, meta, D**-0.5))
    err = (torch.cat(outs).double() - dense_reference(q, k, v, D**-0.5)).abs().max().item()
    assert err < 1e-5, f"max abs diff {err}"


def test_bf16_cache() -> None:
    err = run_case(
        TorchAttentionBackend(cpu_kernel=False), [5, 1, 4], [9, 6, 4], 4, 2, dtype=torch.bfloat16
    )
    assert err < 5e-2, f"max abs diff {err}"


def _no_cascade(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cascade_attention, "MIN_SHARED_BLOCKS", 10**9)


def _plan_tokens(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(cascade decode tokens, plain decode tokens) of the step's TorchAttentionBackend plan."""
    plan = meta.scratch["torch_plan"]
    plain = [] if plan.decode_tokens is None else plan.decode_tokens.tolist()
    return plan.cascade_tokens.tolist(), plain


CASCADE_HEADS = [(4, 2), (9, 3), (8, 1), (4, 4)]


@pytest.mark.parametrize(("hq", "hkv"), CASCADE_HEADS)
def test_cascade_decodes_match_plain_and_reference(
    hq: int, hkv: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 5 shared blocks of 4 = 20 tokens. Row 0 is the shared prefix plus one token, row 2 ends
    # exactly on a block boundary, the others have suffixes of different lengths.
    case = dict(query_lens=[1] * 5, seq_lens=[21, 33, 24, 22, 38], hq=hq, hkv=hkv)
    out, ref, meta = make_case(TorchAttentionBackend(cpu_kernel=False), **case, shared_blocks=5)
    assert _plan_tokens(meta) == ([0, 1, 2, 3, 4], [])
    assert meta.scratch["torch_plan"].cascade.shared_rows.numel() == hkv * 20
    _no_cascade(monkeypatch)
    plain, ref2, meta2 = make_case(TorchAttentionBackend(cpu_kernel=False), **case, shared_blocks=5)
    assert _plan_tokens(meta2) == ([], [0, 1, 2, 3, 4])
    assert torch.equal(ref, ref2)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (plain.double() - ref).abs().max().item() < 1e-5
    assert (out - plain).abs().max().item() < 1e-5


@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (9, 3), (8, 1)])
def test_mixed_batch_with_cascade_decodes(
    hq: int, hkv: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows: cascade decode, fresh prefill, cascade decode (shared prefix + 1), plain decode (own
    # blocks), prefill after a prefix hit on the shared blocks, cascade decode.
    case = dict(query_lens=[1, 7, 1, 1, 6, 1], seq_lens=[23, 7, 21, 30, 26, 29], hq=hq, hkv=hkv)
    sharing = [0, 2, 4, 5]
    out, ref, meta = make_case(
        TorchAttentionBackend(cpu_kernel=False), **case, shared_blocks=5, sharing=sharing
    )
    assert _plan_tokens(meta) == ([0, 8, 16], [9])  # tokens of rows 0, 2, 5 and of row 3
    _no_cascade(monkeypatch)
    plain, _, meta2 = make_case(
        TorchAttentionBackend(cpu_kernel=False), **case, shared_blocks=5, sharing=sharing
    )
    assert _plan_tokens(meta2) == ([], [0, 8, 9, 16])
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (out - plain).abs().max().item() < 1e-5


def test_cascade_bf16_cache() -> None:
    case = dict(query_lens=[1, 1, 1], seq_lens=[21, 30, 25], hq=4, hkv=2, dtype=torch.bfloat16)
    out, ref, meta = make_case(TorchAttentionBackend(cpu_kernel=False), **case, shared_blocks=5)
    assert meta.scratch["torch_plan"].cascade is not None
    assert (out.double() - ref).abs().max().item() < 5e-2


def _tables(rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def test_find_shared_prefix() -> None:
    prefix = [7, 3, 9, 4, 8]
    # Largest group by first block wins; sharing stops at the first differing block.
    rows = [[*prefix, 1, 2], [5, 6, 10, 11, 12, 13], [*prefix, 20], [*prefix[:4], 21, 22]]
    seq_lens = [7 * 4, 6 * 4, 6 * 4, 6 * 4]
    assert find_shared_prefix(_tables(rows), seq_lens, 4) == ([0, 2, 3], 4)
    # A row's last block (the one holding its newest token) never counts as shared.
    rows = [[*prefix, 1], [*prefix, 2], prefix]
    assert find_shared_prefix(_tables(rows), [24, 24, 20], 4) == ([0, 1, 2], 4)
    assert find_shared_prefix(_tables(rows), [24, 24, 21], 4) == ([0, 1, 2], 5)
    # Too few shared blocks, rows too short to share 4 blocks, no common first block: none.
    rows = [[7, 3, 9, 1, 5, 6], [7, 3, 9, 2, 5, 6]]
    assert find_shared_prefix(_tables(rows), [24, 24], 4) == ([], 0)
    assert find_shared_prefix(_tables([[7, 3, 9], [7, 3, 9]]), [12, 12], 4) == ([], 0)
    assert find_shared_prefix(_tables([[*prefix, 1], [2] * 6]), [24, 24], 4) == ([], 0)


def test_metadata_build() -> None:
    meta = AttentionMetadata.build([3, 1], [5, 6], [[7, 2, 3], [4, 0, 8, 1]], 2, "cpu")
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2, 3, 0], [4, 0, 8, 1]]
    # seq 0 writes positions 2, 3, 4 -> (block 2, 0), (2, 1), (3, 0); seq 1 position 5 -> (8, 1)
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [4, 5, 6, 17]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_tokens) == (3, 6, 4)
    assert meta.query_lens_cpu == [3, 1] and meta.seq_lens_cpu == [5, 6]


def test_metadata_errors() -> None:
    with pytest.raises(ValueError, match="blocks cannot hold"):
        AttentionMetadata.build([3], [5], [[7, 2]], 2, "cpu")
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([0], [5], [[7, 2, 3]], 2, "cpu")
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionMetadata.build([1], [5, 3], [[7, 2, 3]], 2, "cpu")


def test_get_attn_backend() -> None:
    assert isinstance(get_attn_backend("torch", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attn_backend(None, "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attn_backend("paged", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        get_attn_backend("flash", "cpu")


def _flash_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "flash backend needs a CUDA device"
    if importlib.util.find_spec("vllm_flash_attn") is None:
        return "vllm_flash_attn is not installed (pip install 'kvmesh[gpu]')"
    return None


@pytest.mark.skipif(_flash_skip_reason() is not None, reason=str(_flash_skip_reason()))
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_flash_backend_matches_reference(hq: int, hkv: int) -> None:
    backend = FlashAttentionBackend()
    err = run_case(
        backend,
        [5, 1, 40, 1, 20],
        [37, 7, 40, 90, 50],
        hq,
        hkv,
        block_size=16,
        num_blocks=32,
        device="cuda",
        dtype=torch.bfloat16,
    )
    assert err < 5e-2, f"max abs diff {err}"


CFG = ModelConfig(
    vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=8,
)  # fmt: skip


def test_parse_memory() -> None:
    assert parse_memory("1GiB") == 1024**3
    assert parse_memory("512MiB") == 512 * 1024**2
    assert parse_memory("1.5 GB") == 1_500_000_000
    assert parse_memory("4096") == 4096 and parse_memory(123) == 123
    for bad in ("", "lots", "1 XB", "-1GiB", "1.2.3MiB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_memory(bad)
    with pytest.raises(ValueError):
        parse_memory(-5)


def test_kv_cache_layout_and_offsets() -> None:
    cache = KVCache.allocate(CFG, num_blocks=5, block_size=4, dtype=torch.float16, device="cpu")
    assert cache.data.shape == (3, 2, 5, 4, 2, 8)
    assert cache.block_nbytes == 4 * 2 * 8 * 2
    k1, v1 = cache.layer(1)
    assert k1.shape == (5, 4, 2, 8) and k1.is_contiguous()
    assert v1.data_ptr() - cache.data.data_ptr() == cache.block_offset(1, 1, 0)
    base = cache.data.data_ptr()
    for layer, kv, block in ((0, 0, 0), (1, 1, 3), (2, 0, 4)):
        slab = cache.data[layer, kv, block]
        assert slab.data_ptr() - base == cache.block_offset(layer, kv, block)
    per_block = 3 * 2 * cache.block_nbytes
    assert KVCache.num_blocks_for_memory(CFG, 4, torch.float16, per_block * 10 + 7) == 10
    assert cache.nbytes == 5 * 3 * 2 * cache.block_nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_read_write_block_roundtrip(dtype: torch.dtype) -> None:
    src = KVCache.allocate(CFG, num_blocks=4, block_size=4, dtype=dtype, device="cpu")
    src.data.copy_(torch.randn(src.data.shape))
    dst = KVCache.allocate(CFG, num_blocks=6, block_size=4, dtype=dtype, device="cpu")
    blob = src.read_block(2)
    assert len(blob) == CFG.num_layers * 2 * src.block_nbytes
    dst.write_block(5, blob)
    assert torch.equal(dst.data[:, :, 5], src.data[:, :, 2])
    assert torch.count_nonzero(dst.data[:, :, :5]) == 0
    with pytest.raises(ValueError, match="bytes"):
        dst.write_block(0, blob[:-1])
    with pytest.raises(IndexError):
        src.read_block(4)
