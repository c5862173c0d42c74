"""The shape of a Llama-family model, read from (and written back to) HF's config.json.

`ModelConfig` is built once from a checkpoint's config dict and passed down to the model, the KV
cache and the model fingerprint. It holds only what changes the math or the KV layout; anything
the model cannot honour (other activations, MLP bias, sliding windows that bite) is rejected
here with a ValueError naming the field, rather than silently computing something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF architecture name -> HF model_type (what `to_hf_config` writes back).
_MODEL_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_ROPE_TYPES = ("llama3", "linear")
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family transformer (Llama 2/3, Mistral, Qwen2).

    `rope_scaling` is None for plain RoPE, else a sorted tuple of (key, value) pairs that always
    holds "rope_type" ("llama3" or "linear") and that type's parameters; `rope_scaling_dict`
    gives it back as a dict. `attention_bias` means bias on q/k/v only (Qwen2), never o_proj.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported "
                f"(supported: {', '.join(_MODEL_TYPES)})"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )

    @property
    def q_size(self) -> int:
        """Width of the query projection's output: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """`rope_scaling` as HF's dict form, or None for plain RoPE."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF config.json dict (transformers 4.x or 5.x spelling).

        Raises ValueError naming the offending field when the architecture is unsupported, a
        required field is missing, or the config asks for something this model does not do.
        """
        archs = d.get("architectures") or []
        if len(archs) != 1 or archs[0] not in _MODEL_TYPES:
            raise ValueError(
                f"architectures: {archs!r} is not supported (supported: {', '.join(_MODEL_TYPES)})"
            )
        arch = archs[0]

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ValueError(f"{key}: missing from the {arch} config")
            return d[key]

        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP bias is not supported")
        if arch == "LlamaForCausalLM" and d.get("attention_bias"):
            # Llama's attention_bias also puts a bias on o_proj, which this model lacks.
            raise ValueError("attention_bias: Llama attention bias (incl. o_proj) is unsupported")
        if arch == "Qwen2ForCausalLM" and d.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        rope_theta, rope_scaling = _parse_rope(d)
        max_pos = int(d.get("max_position_embeddings") or 2048)
        window = d.get("sliding_window") if arch == "MistralForCausalLM" else None
        if window is not None:
            # Full attention equals Mistral's sliding window as long as the context fits in it,
            # so cap the context there instead of computing wrong attention beyond it.
            max_pos = min(max_pos, int(window))
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos_ids),
            architecture=arch,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF config.json dict for this model, in the spelling transformers 4.x and 5.x both
        read (rope_theta + rope_scaling), e.g. to build a reference model in tests."""
        eos: int | list[int] | None = (
            None
            if not self.eos_token_ids
            else self.eos_token_ids[0]
            if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids)
        )
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        if self.architecture == "MistralForCausalLM":
            d["sliding_window"] = None
        if self.architecture == "Qwen2ForCausalLM":
            d["use_sliding_window"] = False
        return d


def _parse_rope(d: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling) from 4.x keys (rope_theta, rope_scaling) or 5.x's
    rope_parameters, with the scaling normalised to our sorted-tuple form."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in {**legacy, **params}.items() if k != "rope_theta"}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported "
            f"(supported: default, {', '.join(_ROPE_TYPES)})"
        )
    missing = [k for k in _ROPE_KEYS[rope_type] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling: {rope_type} scaling lacks {', '.join(missing)}")
    kept = {k: scaling[k] for k in _ROPE_KEYS[rope_type]}
    return theta, tuple(sorted({"rope_type": rope_type, **kept}.items()))
