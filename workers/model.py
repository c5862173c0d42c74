"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat, paged batch.

gpt-fast style: the whole model in one file. Shapes use T = tokens in the step (all sequences
back to back), H = hidden size, Hq / Hkv = query / KV heads, D = head dim, V = vocab.
Parameter names equal HF transformers' state-dict names, so an HF checkpoint's tensors load
with `load_state_dict` as they are. The math follows transformers' modeling_llama (RMSNorm in
float32, rotate_half RoPE with float32 tables, SwiGLU), so logits match it closely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.workers.attention import AttentionBackend, AttentionMetadata
from kvmesh.workers.cpu_kernels import require_library
from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.model_config import ModelConfig
from kvmesh.workers.qmatmul import PackedWeight, QuantizedWeight, fuse, pack, qmatmul

# Rows of the RoPE table built at first use (capped by max_position_embeddings); it grows
# (at least doubling) when a step needs more.
_INITIAL_ROPE_ROWS = 4096


class RMSNorm(nn.Module):
    """RMSNorm; given the residual too, it adds it first and returns the sum as the next
    residual (vLLM's fused add): `norm(x)`, or `(norm(x + residual), x + residual)`."""

    # One C call (csrc/norm_rope.c) instead of ~7 torch ops; its sum of squares runs in
    # another order (last-bit differences, fingerprinted). Set by use_cpu_kernels.
    kernel: bool = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> [T, H]
        if self.kernel:
            return self._kernel(x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _kernel(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x is a sublayer's fresh output (or the embeddings' copy), so the sum may go into it.
        x = x.contiguous()
        out = torch.empty_like(x)
        res = residual.contiguous() if residual is not None else None
        rc = require_library().kvn_rmsnorm(
            x.data_ptr(), None if res is None else res.data_ptr(), self.weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], self.eps, torch.get_num_threads(),
        )  # fmt: skip
        assert rc == 0, "use_cpu_kernels checked the hidden size"
        return out if residual is None else (out, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same ops less two no-op casts (~8% of a CPU step's ops)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        # Normalise in float32, cast back, then scale: HF's order, which matters in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear that can multiply through its weight's quantized blocks instead (`qweight`, set
    by `LlamaForCausalLM.use_quantized`, which drops the float32 weight): a CPU decode step then
    reads ~6x fewer weight bytes, which is what bounds it."""

    qweight: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.qweight is not None:
            y = qmatmul(x, self.qweight)
            return y if self.bias is None else y + self.bias
        return super().forward(x)


def project(
    x: torch.Tensor, layers: list[Linear], fused: PackedWeight | None
) -> list[torch.Tensor]:
    """Each layer applied to x; through one kernel call over their concatenated quantized
    panels when `fused` is set (the outputs are then column slices of one tensor)."""
    if fused is None:
        return [layer(x) for layer in layers]
    outs = qmatmul(x, fused).split([layer.out_features for layer in layers], dim=1)
    pairs = zip(outs, layers, strict=True)
    return [o if layer.bias is None else o + layer.bias for o, layer in pairs]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Float32 [D/2] inverse frequencies, with Llama-3 or linear scaling applied as in HF."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: bool = False
) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, bit for bit, in 4 ops instead of 8: rotate_half(x)
    is cat(-x2, x1) and the roll cat(x2, x1), so `sin` comes with its first half negated
    (`LlamaForCausalLM._rope`); negation is exact, so each product is the same float.
    x: [T, heads, D], heads contiguous; cos, sin: [T, 1, D] in x's dtype (HF casts the
    float32 table too). With `kernel` (float32 on CPU), the same bits from one C call, written
    into x."""
    if not kernel:
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()  # read as [T, D] rows (no copy in the model)
    rc = require_library().kvn_rope(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, d,
        torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, "use_cpu_kernels checked the head size"
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.scale = config.head_dim**-0.5
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(h, config.q_size, bias=bias)
        self.k_proj = Linear(h, config.kv_size, bias=bias)
        self.v_proj = Linear(h, config.kv_size, bias=bias)
        self.o_proj = Linear(config.q_size, h, bias=False)
        self.qkv: PackedWeight | None = None  # q, k, v quantized panels fused (use_quantized)
        self.kernel = False  # RoPE through the C kernel (use_cpu_kernels)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], first half negated (apply_rope)
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        t = x.shape[0]
        q, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj], self.qkv)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = apply_rope(q, cos, sin, self.kernel), apply_rope(k, cos, sin, self.kernel)
        k_cache, v_cache = kv_cache.layer(self.layer_idx)  # [N, bs, Hkv, D] each
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i, bias=False)
        self.up_proj = Linear(h, i, bias=False)
        self.down_proj = Linear(i, h, bias=False)
        self.gate_up: PackedWeight | None = None  # gate, up quantized panels fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = project(x, [self.gate_proj, self.up_proj], self.gate_up)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]: the previous layer's output, or the embeddings
        residual: torch.Tensor | None,  # [T, H]: the stream x is added to (None: x is it)
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's output, the residual stream
        # HF's x = x + attn(norm(x)); x = x + mlp(norm(x)), with each add done by the next
        # norm (vLLM's layout), so that the C norm takes it in the same call.
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`forward` runs one step over a flat batch and returns final-norm hidden states; the
    caller picks the rows it wants logits for and calls `compute_logits` on them.

    With tie_word_embeddings there is no `lm_head` module (logits use embed_tokens.weight), and
    `load_state_dict` drops an incoming "lm_head.weight" (HF state dicts of tied models carry
    it as an alias), so strict loading works whether or not the checkpoint has it.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Float32 [P, D] RoPE tables. Plain attributes, not buffers: model.to(dtype) must not
        # cast them, and meta-device init / to_empty() must not leave them uninitialised.
        self._rope_cos = torch.empty(0, config.head_dim)
        self._rope_sin = torch.empty(0, config.head_dim)
        self._tied_qweight: PackedWeight | None = None  # embed_tokens' blocks, for logits

    def _rope(self, positions: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [T, D] at `positions`, sin's first half negated (`apply_rope`); builds
        the table (on positions' device, up to
        max_position_embeddings rows, more if a step asks) the first time it is too small."""
        old = self._rope_cos.shape[0]
        if old < max_seq_len or self._rope_cos.device != positions.device:
            initial = min(_INITIAL_ROPE_ROWS, self.config.max_position_embeddings)
            rows = max(max_seq_len, initial, 2 * old if old < max_seq_len else old)
            inv_freq = rope_inv_freq(self.config).to(positions.device)  # [D/2]
            pos = torch.arange(rows, device=positions.device, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]: rotate_half pairs i with i + D/2
            self._rope_cos, self._rope_sin = emb.cos(), emb.sin()
            self._rope_sin[:, : emb.shape[1] // 2].neg_()
        return self._rope_cos.index_select(0, positions), self._rope_sin.index_select(0, positions)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T], each token's position in its sequence
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self._rope(positions, meta.max_seq_len)  # float32 [T, D]
        # HF casts the table to x's dtype too; [T, 1, D] broadcasts over heads.
        cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> float32 [N, V]
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self._tied_qweight is not None:
            return qmatmul(hidden, self._tied_qweight)
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def use_quantized(self, quantized: Mapping[str, QuantizedWeight]) -> int:
        """Give the linear layers (and tied logits) the quantized blocks of their weights, by
        state-dict name, packed for `qmatmul`; returns how many took them. A linear layer that
        takes them drops its float32 weight (the tied embedding keeps it, for lookups). Only
        for a float32 model on CPU; the values are the same, so logits move ~1e-6."""
        param = self.model.embed_tokens.weight
        if param.device.type != "cpu" or param.dtype != torch.float32:
            raise ValueError(
                f"quantized matmuls need float32 on CPU, not {param.dtype} on {param.device}"
            )
        taken = 0
        for name, qw in quantized.items():
            if name == "model.embed_tokens.weight":
                if self.lm_head is not None:
                    continue  # an untied embedding is only looked up, never multiplied
                module, shape = None, tuple(param.shape)
            else:
                try:
                    module = self.get_submodule(name.removesuffix(".weight"))
                except AttributeError:
                    module = None
                if not isinstance(module, Linear) or not name.endswith(".weight"):
                    raise ValueError(f"quantized: {name!r} is not a linear layer's weight")
                shape = (module.out_features, module.in_features)
            if (qw.out_features, qw.in_features) != shape:
                got = (qw.out_features, qw.in_features)
                raise ValueError(f"quantized: {name!r} is {got}, the model has {shape}")
            if module is None:
                self._tied_qweight = pack(qw)
            else:
                module.qweight = pack(qw)
                del module.weight  # frees the float32 copy; state_dict() no longer lists it
                module.register_parameter("weight", None)
            taken += 1
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = _fuse_into([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up = _fuse_into([mlp.gate_proj, mlp.up_proj])
        return taken

    def use_cpu_kernels(self) -> bool:
        """RMSNorm and RoPE through the C kernels (csrc/norm_rope.c) from now on, each where it
        fits (float32 on CPU; RMSNorm: hidden size a multiple of 8; RoPE: head_dim a multiple
        of 16, at most 512); returns whether RMSNorm took it, the one of the two that changes
        numbers (RoPE's are the same bits). The engine asks exactly when attention takes its
        C kernel too; the fingerprint records both."""
        param = self.model.embed_tokens.weight
        if param.device.type != "cpu" or param.dtype != torch.float32:
            return False
        require_library()
        c = self.config
        norm, rope = c.hidden_size % 8 == 0, c.head_dim % 16 == 0 and c.head_dim <= 512
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = norm
            elif isinstance(module, LlamaAttention):
                module.kernel = rope
        return norm

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        if self.lm_head is None and "lm_head.weight" in state_dict:
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _fuse_into(layers: list[Linear]) -> PackedWeight | None:
    """The layers' panels fused into one weight (each layer's qweight becomes a view of it),
    or None when they cannot fuse."""
    ws = [layer.qweight for layer in layers]
    if any(w is None for w in ws):
        return None
    fused = fuse([w for w in ws if w is not None])
    if fused is None:
        return None
    for layer, view in zip(layers, fused[1], strict=True):
        layer.qweight = view
    return fused[0]
