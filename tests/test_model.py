"""Our LlamaForCausalLM vs transformers' model built from `config.to_hf_config()` with the same
random weights: whole prompt, chunked prefill through the paged cache, decode, mixed batches."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from kvmesh.workers.attention import AttentionMetadata, TorchAttentionBackend
from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.model import LlamaForCausalLM, RMSNorm, apply_rope
from kvmesh.workers.model_config import ModelConfig

TOL = 1e-4
BLOCK = 4
VOCAB = 256

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so test positions reach every regime
}
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}
HF_CONFIGS = {
    "llama3": {
        **COMMON,
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        **COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "mistral": {
        **COMMON,
        "architectures": ["MistralForCausalLM"],
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,  # != hidden / heads, as in Mistral NeMo
        "sliding_window": 4096,
    },
}


def build_pair(name: str) -> tuple[ModelConfig, PreTrainedModel, LlamaForCausalLM]:
    """(config, HF reference, ours) sharing random weights large enough that errors show."""
    config = ModelConfig.from_hf_config(HF_CONFIGS[name])
    hf_dict = config.to_hf_config()
    model_type = hf_dict.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **hf_dict)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in pname else 0.1))
    ours = LlamaForCausalLM(config, TorchAttentionBackend()).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return config, hf, ours


def hf_logits(hf: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


class Runner:
    """Drives our model like an engine would: one growing block table per sequence."""

    def __init__(self, config: ModelConfig, model: LlamaForCausalLM) -> None:
        self.model = model
        self.cache = KVCache.allocate(config, 64, BLOCK, torch.float32, "cpu")
        self.free = list(range(63, 0, -2)) + list(range(62, 0, -2))  # scattered ids
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feed each sequence its next tokens in one flat batch; logits [len, V] per sequence."""
        ids, pos, qlens, slens, tables = [], [], [], [], []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * BLOCK < start + len(toks):
                table.append(self.free.pop())
            self.lens[sid] = start + len(toks)
            ids += toks
            pos += range(start, start + len(toks))
            qlens.append(len(toks))
            slens.append(start + len(toks))
            tables.append(table)
        meta = AttentionMetadata.build(qlens, slens, tables, BLOCK, "cpu")
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.cache, meta)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(qlens))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_prefill_chunked_and_decode_match_hf(name: str) -> None:
    config, hf, ours = build_pair(name)
    ids = prompt(30, 1)
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0, "weights too small for the comparison to mean anything"

    (whole,) = Runner(config, ours).step({0: ids})
    assert max_diff(whole, ref) < TOL, (
        f"{name} one-step prefill: max abs diff {max_diff(whole, ref)}"
    )

    runner = Runner(config, ours)
    (first,) = runner.step({0: ids[:13]})
    (second,) = runner.step({0: ids[13:]})
    chunked = torch.cat([first, second])
    diff = max_diff(chunked, ref)
    assert diff < TOL, f"{name} two-chunk prefill: max abs diff {diff}"

    seq, ours_tokens = list(ids), []
    next_tok = int(second[-1].argmax())
    for _ in range(8):
        ours_tokens.append(next_tok)
        seq.append(next_tok)
        (logits,) = runner.step({0: [next_tok]})
        ref_last = hf_logits(hf, seq)[-1]
        diff = max_diff(logits[0], ref_last)
        assert diff < TOL, f"{name} decode at len {len(seq)}: max abs diff {diff}"
        next_tok = int(logits[0].argmax())
    hf_tokens = hf.generate(
        torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(ids) :].tolist()
    assert ours_tokens == hf_tokens


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_mixed_batch_matches_hf(name: str) -> None:
    """Prefill of a new prompt, a chunk of a half-done one and decodes, in one flat batch."""
    config, hf, ours = build_pair(name)
    a, b, c = prompt(21, 2), prompt(17, 3), prompt(9, 4)
    runner = Runner(config, ours)
    runner.step({1: b[:10], 2: c})
    out = runner.step({0: a, 1: b[10:], 2: [7]})
    for got, ids in ((out[0], a), (out[1], b), (out[2], [*c, 7])):
        ref = hf_logits(hf, ids)[-len(got) :]
        assert max_diff(got, ref) < TOL, f"{name} mixed batch: max abs diff {max_diff(got, ref)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_and_norm_equal_hf_bit_for_bit(dtype: torch.dtype) -> None:
    # apply_rope rolls x and takes sin with its first half negated where HF concatenates
    # (-x2, x1); RMSNorm skips HF's casts in float32. Both must be the same floats, not close.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config, hf, ours = build_pair("llama3")
    t, d = 40, config.head_dim
    pos = torch.arange(100, 100 + t)
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(t, 4, d, generator=g) * 3).to(dtype)
    k = (torch.randn(t, 2, d, generator=g) * 3).to(dtype)
    hf_cos, hf_sin = hf.model.rotary_emb(q, pos[None])  # [1, T, D] in q's dtype
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          hf_cos, hf_sin)  # fmt: skip
    cos, sin = ours._rope(pos, 200)
    cos, sin = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
    assert torch.equal(apply_rope(q, cos, sin), want_q[0].transpose(0, 1))
    assert torch.equal(apply_rope(k, cos, sin), want_k[0].transpose(0, 1))

    norm = RMSNorm(config.hidden_size, 1e-5).to(dtype)
    hf_norm = hf.model.norm.to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(config.hidden_size, generator=g))
        hf_norm.weight.copy_(norm.weight)
        x = (torch.randn(t, config.hidden_size, generator=g) * 5).to(dtype)
        assert torch.equal(norm(x), hf_norm(x))


def test_bf16_model_runs_close_to_float32() -> None:
    config, hf, ours = build_pair("llama3")
    ids = prompt(20, 5)
    ref = hf_logits(hf, ids)
    ours = ours.to(torch.bfloat16)
    runner = Runner(config, ours)
    runner.cache = KVCache.allocate(config, 64, BLOCK, torch.bfloat16, "cpu")
    (logits,) = runner.step({0: ids})
    assert max_diff(logits, ref) < 0.25 * ref.abs().max().item()


def test_state_dict_names_equal_hf() -> None:
    for name in HF_CONFIGS:
        config, hf, ours = build_pair(name)
        hf_names = set(hf.state_dict())
        if config.tie_word_embeddings:
            hf_names.discard("lm_head.weight")
        assert set(ours.state_dict()) == hf_names
        assert ("model.layers.0.self_attn.q_proj.bias" in hf_names) == config.attention_bias
        # A checkpoint of a tied model usually omits lm_head.weight: strict load still works.
        ours.load_state_dict({k: v for k, v in hf.state_dict().items() if k in hf_names})


def test_config_from_hf_spellings_and_roundtrip() -> None:
    llama = ModelConfig.from_hf_config(HF_CONFIGS["llama3"])
    assert llama.head_dim == 16 and llama.num_kv_heads == 2 and llama.eos_token_ids == (2, 3)
    assert llama.rope_scaling_dict == LLAMA3_ROPE and not llama.attention_bias
    assert ModelConfig.from_hf_config(llama.to_hf_config()) == llama
    # transformers 5.x spelling: rope_parameters holds rope_theta and the scaling.
    v5 = {k: v for k, v in HF_CONFIGS["llama3"].items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    assert ModelConfig.from_hf_config(v5) == llama
    qwen = ModelConfig.from_hf_config(HF_CONFIGS["qwen2"])
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.rope_scaling is None
    mistral = ModelConfig.from_hf_config({**HF_CONFIGS["mistral"], "max_position_embeddings": 9999})
    assert mistral.head_dim == 32 and mistral.max_position_embeddings == 4096


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"vocab_size": None}, "vocab_size"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_config_rejects(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config({**HF_CONFIGS["llama3"], **change})
