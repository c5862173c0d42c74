"""RMSNorm and RoPE through csrc/norm_rope.c against model.py's torch code: RoPE bit for bit
(strided q/k slices, the threaded path too), RMSNorm within float32 rounding with the residual
sum exact, a model's logits with and without them, and the fingerprint naming the C norm.
Each test runs once per build (AVX-512, AVX2 + FMA) this CPU can run."""

from __future__ import annotations

import pytest
import torch

from kvmesh import LLM
from kvmesh.workers.model import RMSNorm, apply_rope
from tests.test_cpu_kernels import isa  # noqa: F401  (autouse: once per build)
from tests.test_model import HF_CONFIGS, TOL, Runner, build_pair, hf_logits, max_diff, prompt

GEN = torch.Generator().manual_seed(0)


def rope_tables(t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t, 1, d] as the model passes them (sin's first half negated)."""
    pos = torch.randint(0, 5000, (t,), generator=GEN).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(pos, inv)] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    sin[:, : d // 2].neg_()
    return cos[:, None, :], sin[:, None, :]


@pytest.mark.parametrize("t,heads,d", [(1, 9, 64), (5, 3, 64), (7, 4, 128), (300, 9, 64)])
def test_rope_kernel_equals_torch_bit_for_bit(t: int, heads: int, d: int) -> None:
    # q as the fused projection leaves it: a column slice of a wider row (stride > heads * d).
    wide = torch.randn(t, heads * d + 3 * d, generator=GEN) * 4
    x = wide[:, : heads * d].view(t, heads, d)
    cos, sin = rope_tables(t, d)
    want = apply_rope(x, cos, sin)
    rest = wide[:, heads * d :].clone()
    got = apply_rope(x, cos, sin, kernel=True)
    assert torch.equal(got, want)  # a fused multiply-add anywhere would round differently
    assert got.data_ptr() == wide.data_ptr()  # written in place, into the slice only
    assert torch.equal(wide[:, heads * d :], rest)


@pytest.mark.parametrize("t", [1, 8, 64])
def test_rmsnorm_kernel_matches_torch_and_adds_the_residual_exactly(t: int) -> None:
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=GEN))
    x = torch.randn(t, 576, generator=GEN) * 3
    r = torch.randn(t, 576, generator=GEN) * 3
    with torch.inference_mode():
        want, want_sum = norm(x, r)
        want_plain = norm(x)
        norm.kernel = True
        got_plain = norm(x.clone())
        got, got_sum = norm(x.clone(), r)
    assert torch.equal(got_sum, want_sum)  # x + residual: one rounding either way
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_plain, want_plain, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got_plain, torch.zeros_like(got_plain))


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_model_with_the_kernels_matches_hf(name: str) -> None:
    config, hf, ours = build_pair(name)
    assert ours.use_cpu_kernels()
    assert ours.model.norm.kernel
    # qwen2's heads here are 8 wide: RoPE stays with torch, RMSNorm takes the kernel.
    assert ours.model.layers[0].self_attn.kernel == (config.head_dim % 16 == 0)
    ids = prompt(30, 1)
    runner = Runner(config, ours)
    (first,) = runner.step({0: ids[:13]})
    (second,) = runner.step({0: ids[13:]})
    assert max_diff(torch.cat([first, second]), hf_logits(hf, ids)) < TOL
    seq, tokens, last = list(ids), [], second[-1]
    for _ in range(6):
        tokens.append(int(last.argmax()))
        seq.append(tokens[-1])
        (logits,) = runner.step({0: [tokens[-1]]})
        last = logits[0]
        assert max_diff(last, hf_logits(hf, seq)[-1]) < TOL
    want = hf.generate(
        torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(ids) :].tolist()
    assert tokens == want


def test_fingerprint_names_the_c_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    kw = {"block_size": 4, "num_kv_blocks": 16, "progress": False}
    on = LLM("tiny-random", **kw).engine
    assert on.fingerprint.rmsnorm == "cpu_kernel" and on.model.model.norm.kernel
    assert on.fingerprint.attention.endswith("+cpu_kernel.v2")
    monkeypatch.setenv("KVMESH_CPU_KERNELS", "0")
    off = LLM("tiny-random", **kw).engine
    assert off.fingerprint.rmsnorm == "torch" and not off.model.model.norm.kernel
    assert off.fingerprint.attention == "TorchAttentionBackend"
    assert off.fingerprint.id != on.fingerprint.id
