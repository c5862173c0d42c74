"""The C kernels for CPU: quantized matmuls against gguf's own dequantizer and F.linear, the paged
attention kernel against a dense reference, and an engine on quantized GGUF weights against
HF transformers loading the same file. Each test runs once per build (AVX-512, AVX2 + FMA) that
this CPU can run; the two builds must also agree bit for bit."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GT

from kvmesh import LLM, SamplingParams
from kvmesh.workers import cpu_kernels
from kvmesh.workers.attention import AttentionMetadata, TorchAttentionBackend
from kvmesh.workers.cpu_kernels import kernel_library
from kvmesh.workers.loader import load_weights
from kvmesh.workers.model import LlamaForCausalLM
from kvmesh.workers.qmatmul import QuantizedWeight, dequantize, fuse, pack, qmatmul
from tests.gguf_helpers import write_gguf
from tests.test_attention import make_case

TYPES = [GT.Q4_0, GT.Q4_1, GT.Q8_0]
ISA_BITS = {"avx512": 512, "avx2": 256}


@pytest.fixture(autouse=True, params=list(ISA_BITS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test with `KVMESH_CPU_ISA` set to each build in turn (so qmatmul and the
    attention backend load that build), skipped where this CPU or compiler can't have it."""
    monkeypatch.delenv("KVMESH_CPU_KERNELS", raising=False)
    lib = kernel_library(request.param)
    if lib is None:
        pytest.skip(f"no {request.param} build here (CPU flags or C compiler)")
    assert lib.kvmesh_isa_bits() == ISA_BITS[request.param]
    monkeypatch.setenv("KVMESH_CPU_ISA", request.param)
    return request.param


def quantized(n: int, k: int, qtype: GT, scale: float = 0.05, seed: int = 0):
    """(QuantizedWeight, gguf's float32 dequantization of it) for a random [n, k] weight."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * scale
    blocks = gguf.quants.quantize(w, qtype)
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))
    return QuantizedWeight(int(qtype), torch.from_numpy(blocks), k), ref


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [0.05, 1e-6], ids=["normal", "subnormal-scales"])
def test_dequantize_equals_gguf_exactly(qtype: GT, scale: float) -> None:
    qw, ref = quantized(37, 96, qtype, scale)
    assert torch.equal(dequantize(qw), ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 5, 12, 16, 17, 40])
def test_qmatmul_matches_float32_linear(qtype: GT, m: int) -> None:
    # 37 rows: the last 16-row panel is partial; 12, 17 and 40 rows of x span several passes
    # (AVX2: 1-4 rows take both halves of a panel at once, 5-8 one half at a time, 9 or more
    # a dequantized panel in tiles of up to 6 rows).
    qw, ref = quantized(37, 96, qtype)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    want = F.linear(x.double(), ref.double())
    got = qmatmul(x, pack(qw))
    assert got.shape == (m, 37) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    # A strided x is made contiguous, not misread.
    wide = torch.randn(m, 192)
    wide[:, ::2] = x
    assert torch.allclose(qmatmul(wide[:, ::2], pack(qw)), got)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_qmatmul_row_does_not_depend_on_its_batch(qtype: GT) -> None:
    # Every pass kind (16, 5-8 or 1-4 rows; one half of a panel or both; tiles of 1-6 rows
    # over a dequantized panel) sums each output in the same order, so a token's logits are
    # the same bits whoever shares its step.
    pw = pack(quantized(45, 96, qtype)[0])
    x = torch.randn(21, 96, generator=torch.Generator().manual_seed(2))
    whole = qmatmul(x, pw)
    for a, b in [(0, 1), (3, 5), (4, 8), (1, 10), (2, 14), (0, 17), (13, 21)]:
        assert torch.equal(qmatmul(x[a:b], pw), whole[a:b]), (a, b)


def test_qmatmul_after_a_narrower_weight() -> None:
    # The AVX2 tiles keep each thread's dequantized-panel buffer between calls; a wider weight
    # after a narrower one must grow it, not overrun it.
    for k in (64, 1024, 96):
        qw, ref = quantized(40, k, GT.Q4_1, seed=k)
        x = torch.randn(20, k, generator=torch.Generator().manual_seed(k))
        want = F.linear(x.double(), ref.double())
        got = qmatmul(x, pack(qw)).double()
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item(), k


def test_bad_inputs_raise_value_error() -> None:
    qw, _ = quantized(16, 64, GT.Q4_1)
    pw = pack(qw)
    with pytest.raises(ValueError, match="x: has 32 columns"):
        qmatmul(torch.randn(2, 32), pw)
    with pytest.raises(ValueError, match="x: expected float32"):
        qmatmul(torch.randn(2, 64, dtype=torch.float64), pw)
    with pytest.raises(ValueError, match="ggml_type"):
        QuantizedWeight(int(GT.Q6_K), qw.blocks, 64)
    with pytest.raises(ValueError, match="blocks: expected contiguous uint8"):
        QuantizedWeight(int(GT.Q4_1), qw.blocks[:, :20].contiguous(), 64)
    with pytest.raises(ValueError, match="in_features"):
        QuantizedWeight(int(GT.Q4_1), qw.blocks, 48)
    w = load_weights("tiny-random", progress=False)
    model = LlamaForCausalLM(w.config, TorchAttentionBackend())
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.norm.weight", "model.x.weight"):
        with pytest.raises(ValueError, match="is not a linear layer's weight"):
            model.use_quantized({name: qw})
    with pytest.raises(ValueError, match=r"is \(16, 64\), the model has \(64, 64\)"):
        model.use_quantized({"model.layers.0.self_attn.q_proj.weight": qw})


@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 1), (4, 4)])
def test_attention_kernel_long_contexts_and_chunk_edges(hq: int, hkv: int) -> None:
    # Contexts over the kernel's 128-key chunks. Row 0's 20 queries straddle the chunk edge at
    # 128, so its first queries see nothing in the second chunk; row 3 has 33 new tokens and
    # goes to SDPA, next to the kernel in the same step.
    case = dict(query_lens=[20, 1, 1, 33, 1], seq_lens=[140, 300, 129, 200, 128], hq=hq, hkv=hkv)
    out, ref, meta = make_case(
        TorchAttentionBackend(cpu_kernel=True), **case, block_size=16, num_blocks=80
    )
    plan = meta.scratch["torch_plan"]
    assert plan.kernel.tokens.tolist() == [*range(20), 20, 21, 55]
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("head_dim", [64, 24], ids=["d64", "d24"])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 1), (9, 3), (6, 2)])
def test_attention_kernel_rows_of_few_query_heads(hq: int, hkv: int, head_dim: int) -> None:
    # Rows whose query heads per KV head are at most 6 (decodes at 3 heads a KV head, 2
    # tokens at 3) take the kernel's `rows` path when head_dim is a multiple of 16, its
    # `lanes` path otherwise (24), as do the rest (decodes at 8 heads a KV head, 3 tokens
    # at 3). Row 1's two queries end at key 129: the first sees nothing past the 128-key
    # chunk edge; row 2 has one key.
    case = dict(query_lens=[1, 2, 1, 3, 1], seq_lens=[300, 129, 1, 140, 257], hq=hq, hkv=hkv)
    out, ref, _ = make_case(
        TorchAttentionBackend(cpu_kernel=True), **case, block_size=16, num_blocks=100,
        head_dim=head_dim,
    )  # fmt: skip
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [48, 64, 128])
def test_attention_kernel_rows_take_one_to_six_query_heads(
    head_dim: int, kv_dtype: torch.dtype
) -> None:
    # `rows` runs all of a task's query heads through each key together, with their count a
    # constant: one to six (1 to 6 new tokens at one query head a KV head) each take their
    # own code, and head_dim 48 leaves a partial pass of V sums (3 vectors of d against
    # passes of 4, or of 2 on AVX2). A bfloat16 cache is read in pairs at 64 and 128.
    # Rows straddle the 128-key chunk edge; a query head's sums written to another's
    # output, or a V pass that skips a vector, is far off the reference.
    case = dict(query_lens=[1, 2, 3, 4, 5, 6], seq_lens=[300, 129, 140, 257, 200, 136])
    out, ref, meta = make_case(
        TorchAttentionBackend(cpu_kernel=True), **case, hq=2, hkv=2, block_size=16,
        num_blocks=100, head_dim=head_dim, kv_dtype=kv_dtype,
    )  # fmt: skip
    assert meta.scratch["torch_plan"].kernel.num_tokens == 21
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
@pytest.mark.parametrize(("hq", "hkv"), [(7, 1), (9, 3), (16, 2)])
def test_attention_kernel_lanes_sum_v_in_tiles(hq: int, hkv: int, head_dim: int) -> None:
    # `lanes` rows (7 or more query heads a KV head, or several tokens) sum V with head_dim in
    # the vector, in tiles of query heads and of head_dim: 7, 8, 9, 24 and 60 query heads and
    # 1 to 8 vectors of head_dim make full tiles and partial ones in both builds. Row 0's 20
    # queries straddle the 128-key chunk edge; a V row read at the wrong place, or a tile's
    # query head written to another's output, is far off the reference.
    case = dict(query_lens=[20, 1, 3, 1, 8], seq_lens=[140, 300, 129, 17, 2056], hq=hq, hkv=hkv)
    out, ref, meta = make_case(
        TorchAttentionBackend(cpu_kernel=True), **case, block_size=16, num_blocks=180,
        head_dim=head_dim,
    )  # fmt: skip
    assert meta.scratch["torch_plan"].kernel.num_tokens == 33
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_attention_kernel_reads_a_shared_prefix_once() -> None:
    # Six decode rows share 10 blocks (160 keys, two chunks): one shared item, then one item
    # per row for its own blocks, merged per query head.
    case = dict(query_lens=[1] * 6, seq_lens=[161, 175, 200, 176, 190, 163], hq=9, hkv=3)
    out, ref, meta = make_case(
        TorchAttentionBackend(cpu_kernel=True), **case, block_size=16, num_blocks=80,
        shared_blocks=10,
    )  # fmt: skip
    kernel = meta.scratch["torch_plan"].kernel
    assert kernel.num_items == 7
    kv_len = kernel._arrays[1].tolist()
    assert kv_len == [160, 1, 15, 40, 16, 30, 3]
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("kv_dtype", "head_dim"),
    [(torch.float16, 64), (torch.float16, 24), (torch.bfloat16, 24), (torch.bfloat16, 64)],
    ids=["f16-d64", "f16-d24", "bf16-d24", "bf16-d64"],
)
def test_attention_kernel_reads_a_16_bit_cache_as_its_float32_values(
    kv_dtype: torch.dtype, head_dim: int
) -> None:
    # A float16 cache, and any bfloat16 row `rows` does not read in pairs, is widened exactly:
    # the output equals, bit for bit, the output on a float32 cache holding the same values,
    # through `rows` (decodes, d 64), `lanes` (20 and 3 new tokens, a shared prefix, d 24);
    # SDPA takes the 33-token row. bfloat16 decodes at d 64 are read in pairs (the next
    # test): there, only close to the reference.
    case = dict(query_lens=[20, 1, 1, 3, 1, 33], seq_lens=[140, 300, 161, 200, 170, 220])
    args = dict(**case, hq=9, hkv=3, block_size=16, num_blocks=120, head_dim=head_dim,
                shared_blocks=10, sharing=[1, 2, 4], kv_dtype=kv_dtype)  # fmt: skip
    out, ref, meta = make_case(TorchAttentionBackend(cpu_kernel=True), **args)
    assert meta.scratch["torch_plan"].kernel.num_tokens == 26
    wide, _, _ = make_case(
        TorchAttentionBackend(cpu_kernel=True), **args, cache_dtype=torch.float32
    )
    assert torch.equal(out, wide) == (kv_dtype == torch.float16 or head_dim % 32 != 0)
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_kernel_reads_bfloat16_in_pairs_as_float32_in_pair_order(
    head_dim: int,
) -> None:
    # `rows` reads a bfloat16 row as its even entries, then its odd ones (per 32), in place.
    # That is the float32 path's sum over head_dim in that order: the same decodes on a
    # float32 cache (and q) whose head_dim is permuted into pair order give the same bits,
    # once the output's head_dim is put back.
    gen = torch.Generator().manual_seed(3)
    bs, hq, hkv, lens = 16, 9, 3, [300, 1, 129, 260]
    nb = sum(-(-n // bs) for n in lens) + 1
    ids = torch.randperm(nb - 1, generator=gen).add(1).tolist()
    tables = [[ids.pop() for _ in range(-(-n // bs))] for n in lens]
    cache = [torch.randn(nb, bs, hkv, head_dim, generator=gen).bfloat16() for _ in "kv"]
    q, k, v = (torch.randn(len(lens), h, head_dim, generator=gen) for h in (hq, hkv, hkv))
    k, v = k.bfloat16().float(), v.bfloat16().float()
    order = [
        dd
        for c in range(0, head_dim, 32)
        for dd in [*range(c, c + 32, 2), *range(c + 1, c + 32, 2)]
    ]

    def attend(q, k, v, caches):
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, bs, "cpu")
        out = TorchAttentionBackend(cpu_kernel=True).forward(q, k, v, *caches, meta, 0.125)
        assert meta.scratch["torch_plan"].kernel.num_tokens == len(lens)
        return out

    out = attend(q, k, v, [c.clone() for c in cache])
    permuted = [c.float()[..., order].contiguous() for c in cache]
    same = attend(q[..., order], k[..., order], v[..., order], permuted)
    back = torch.empty_like(same)
    back[..., order] = same
    assert torch.equal(out, back)
    wide = attend(q, k, v, [c.float() for c in cache])
    assert (out - wide).abs().max().item() < 1e-5


MIXED = {"self_attn.q_proj": GT.Q4_0, "self_attn.k_proj": GT.Q4_1, "mlp.down_proj": GT.Q4_1}


def qtype_of(name: str) -> GT:
    return next((t for part, t in MIXED.items() if f".{part}." in name), GT.Q8_0)


@pytest.mark.slow
def test_engine_on_quantized_gguf_matches_hf_from_the_same_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_gguf(load_weights("tiny-random", progress=False), tmp_path / "q.gguf", qtype_of)
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, local_files_only=True, dtype=torch.float32
    ).eval()
    quant = LLM(str(path), block_size=4, num_kv_blocks=64, progress=False)
    plain = LLM(str(path), block_size=4, num_kv_blocks=64, progress=False, quantized_matmul=False)
    # Every linear weight (2 layers x 7, plus the untied lm_head) went over to its blocks.
    assert quant.engine.num_quantized_weights == 15 and plain.engine.num_quantized_weights == 0
    assert quant.engine.model.model.layers[0].mlp.up_proj.weight is None

    prompts = [[5, 80, 3, 200, 17, 9, 44], [100 + i for i in range(37)], [7] * 3]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    outs = zip(
        prompts, quant.generate(prompts, params), plain.generate(prompts, params), strict=True
    )
    for ids, q, p in outs:
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids):].tolist()  # fmt: skip
        assert q.token_ids == want == p.token_ids
        for tok, a, b in zip(q.token_ids, q.logprobs, p.logprobs, strict=True):
            assert abs(a[tok] - b[tok]) < 1e-4


def test_fused_projections_equal_separate_ones() -> None:
    (a, _), (b, _), (c, _) = (quantized(n, 64, GT.Q4_1, seed=n) for n in (32, 16, 48))
    pa, pb, pc = pack(a), pack(b), pack(c)
    fused, views = fuse([pa, pb, pc])
    x = torch.randn(5, 64)
    assert torch.equal(qmatmul(x, fused), torch.cat([qmatmul(x, w) for w in (pa, pb, pc)], 1))
    assert all(torch.equal(v.panels, w.panels) for v, w in zip(views, (pa, pb, pc), strict=True))
    assert views[1].panels.data_ptr() == fused.panels.data_ptr() + len(pa.panels)  # views
    odd, _ = quantized(17, 64, GT.Q4_1)
    other, _ = quantized(16, 64, GT.Q8_0)
    assert fuse([pa, pack(odd)]) is None  # a partial panel would shift the rows after it
    assert fuse([pa, pack(other)]) is None


def test_builds_agree_bit_for_bit(isa: str) -> None:
    # The AVX2 code sums in the AVX-512 code's order, and computes exp the same way. 45 rows:
    # the last panel's second 8-row half is partial; 21 rows of x: 16 + 5 and 8 + 8 + 5.
    if isa != "avx2" or kernel_library("avx512") is None:
        pytest.skip("compares the AVX2 build with the AVX-512 build on a CPU that has both")
    x = torch.randn(21, 96, generator=torch.Generator().manual_seed(1))
    for qtype in TYPES:
        pw = pack(quantized(45, 96, qtype)[0])
        got = qmatmul(x, pw)
        assert cpu_kernels.kernel_library().kvmesh_isa_bits() == 256
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVMESH_CPU_ISA", "avx512")
            assert torch.equal(qmatmul(x, pw), got)
    # Decodes go through the kernel's `rows` path (16-wide vectors over head_dim), the rest
    # through `lanes`; both builds sum in the same order there too.
    case = dict(query_lens=[20, 1, 1, 3, 1], seq_lens=[140, 300, 129, 200, 128], hq=9, hkv=3)
    for head_dim in (16, 64):
        out, _, _ = make_case(TorchAttentionBackend(cpu_kernel=True), **case, block_size=16,
                              num_blocks=80, head_dim=head_dim)  # fmt: skip
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVMESH_CPU_ISA", "avx512")
            out512, _, _ = make_case(TorchAttentionBackend(cpu_kernel=True), **case,
                                     block_size=16, num_blocks=80, head_dim=head_dim)  # fmt: skip
        assert torch.equal(out, out512), head_dim


# Overrides the autouse `isa` fixture: these run whatever the CPU is.
@pytest.mark.parametrize("isa", ["any"])
def test_fallback_reason_is_logged_once(
    isa: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_reported", set())
    caplog.set_level("INFO", logger=cpu_kernels.__name__)
    monkeypatch.setenv("KVMESH_CPU_KERNELS", "0")
    assert kernel_library() is None and kernel_library() is None
    assert kernel_library("avx2") is None
    monkeypatch.delenv("KVMESH_CPU_KERNELS")
    monkeypatch.setenv("KVMESH_CPU_ISA", "avx1024")
    assert kernel_library() is None and kernel_library() is None
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "CPU kernels off, pure torch instead: KVMESH_CPU_KERNELS=0",
        "CPU kernels off, pure torch instead: KVMESH_CPU_ISA='avx1024' is none of auto, "
        "avx512, avx2",
    ]


@pytest.mark.parametrize("isa", ["any"])
def test_a_cpu_without_the_flags_falls_back(
    isa: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_reported", set())
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : fpu sse2 avx f16c")
    cpu_kernels._load.cache_clear()
    try:
        caplog.set_level("INFO", logger=cpu_kernels.__name__)
        monkeypatch.delenv("KVMESH_CPU_KERNELS", raising=False)
        monkeypatch.setenv("KVMESH_CPU_ISA", "auto")
        assert kernel_library() is None and kernel_library() is None
        assert kernel_library("avx2") is None
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : avx avx2 fma f16c")
        cpu_kernels._load.cache_clear()
        assert cpu_kernels.supported_isas() == ["avx2"]
        assert kernel_library("avx512") is None
    finally:
        cpu_kernels._load.cache_clear()  # later tests load the real builds again
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "this CPU has neither AVX-512 nor AVX2 + FMA + F16C",
        "the avx2 build needs avx2 fma, which this CPU lacks",
        "the avx512 build needs avx512f, which this CPU lacks",
    ]
