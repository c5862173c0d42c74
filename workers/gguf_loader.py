"""Read a llama-architecture GGUF file into an HF config dict and an HF-named state dict (its
tokenizer: tokenizer_loader.py).

GGUF stores tensors under llama.cpp's names (`blk.N.attn_q.weight`), possibly quantized, and
llama.cpp's converter permutes the rows of q_proj/k_proj so that each head's RoPE pairs sit next
to each other (GPT-J layout) instead of half a head apart (HF's rotate_half layout). This module
dequantizes to float32, renames to HF Llama names and undoes that permutation, so the result is
what `LlamaForCausalLM.state_dict()` would hold for the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from kvmesh.workers.qmatmul import BLOCK_BYTES, QuantizedWeight

# llama.cpp per-layer tensor name -> HF name inside `model.layers.N.`.
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_MISSING = object()


def read_gguf(
    path: Path, *, progress: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Parse `path` and return `(hf_config, state_dict, quantized)`.

    `hf_config` is a config.json-style dict for `LlamaForCausalLM`; `state_dict` maps HF Llama
    parameter names to contiguous float32 tensors, q/k rows back in HF order. There is no
    `lm_head.weight` when the file has no `output.weight` (then `tie_word_embeddings` is true).
    `quantized` holds, under the same names, the stored blocks of every 2-D tensor whose type
    `qmatmul` multiplies directly (Q4_0 / Q4_1 / Q8_0), rows in HF order too.
    Raises ValueError when the file is not a readable GGUF, is not llama-architecture, or holds
    tensors or settings this loader does not understand.
    """
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises assorted types (ValueError, IndexError, ...) on bad input
        msg = f"{path} is not a readable GGUF file: truncated or corrupt ({type(e).__name__}: {e})"
        raise ValueError(msg) from e
    arch = _field(reader, "general.architecture", None)
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: llama3-style rope scaling (rope_freqs tensor) is not supported")
    hf_config = _hf_config(reader, path, tensor_names)
    n_heads, n_kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]

    state_dict: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    desc = f"dequantizing {path.name}"
    for t in tqdm(reader.tensors, desc=desc, unit="tensor", disable=not progress):
        hf_name = _hf_name(t.name)
        if hf_name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for a llama model")
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: {t.name} has unsupported type {t.tensor_type.name}") from e
        w = torch.from_numpy(np.array(array, dtype=np.float32))
        blocks = None
        if int(t.tensor_type) in BLOCK_BYTES and w.dim() == 2:
            blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # [N, row bytes], a copy
        heads = n_heads if ".q_proj." in hf_name else n_kv_heads if ".k_proj." in hf_name else 0
        if heads:
            w = unpermute_rope_rows(w, heads)
            blocks = None if blocks is None else unpermute_rope_rows(blocks, heads)
        state_dict[hf_name] = w.contiguous()
        if blocks is not None:
            quantized[hf_name] = QuantizedWeight(
                int(t.tensor_type), blocks.contiguous(), in_features=w.shape[1]
            )
    return hf_config, state_dict, quantized


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `LlamaModel.permute` on a q/k weight or bias (rows = heads *
    head_dim): per head, rows [0, 2, 4, ..., 1, 3, 5, ...] go back to [0, 1, 2, ...]."""
    head_dim = w.shape[0] // n_heads
    # llama.cpp: reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2); this reverses it.
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` (HF -> GGUF row order); the inverse of
    `unpermute_rope_rows`, used to write GGUF files in tests."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    """HF name for a llama.cpp tensor name, or None if it is not one we know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    if parts[2] not in _LAYER_NAMES or parts[3] not in ("weight", "bias"):
        return None
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """A metadata value; `default` if absent, else a ValueError naming the key."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _hf_config(reader: Any, path: Path, tensor_names: set[str]) -> dict[str, Any]:
    """config.json-style dict from `llama.*` / `tokenizer.ggml.*` metadata."""
    try:
        hidden = int(_field(reader, "llama.embedding_length"))
        n_heads = int(_field(reader, "llama.attention.head_count"))
        embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        cfg: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            # The embedding's rows, not the token list, decide what the weights can index.
            "vocab_size": int(embd.shape[-1]),
            "hidden_size": hidden,
            "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
            "num_hidden_layers": int(_field(reader, "llama.block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
            "head_dim": int(_field(reader, "llama.attention.key_length", hidden // n_heads)),
            "hidden_act": "silu",
            "rms_norm_eps": _f32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
            "rope_theta": _f32(_field(reader, "llama.rope.freq_base", 10000.0)),
            "rope_scaling": _rope_scaling(reader),
            "max_position_embeddings": int(_field(reader, "llama.context_length")),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
            "eos_token_id": _eos_ids(reader),
        }
    except (ValueError, StopIteration) as e:
        what = "no token_embd.weight tensor" if isinstance(e, StopIteration) else str(e)
        raise ValueError(f"{path}: incomplete llama GGUF: {what}") from e
    if any(n.endswith(".bias") for n in tensor_names):
        raise ValueError(f"{path}: llama attention/MLP biases are not supported")
    return cfg


def _rope_scaling(reader: Any) -> dict[str, Any] | None:
    kind = _field(reader, "llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_field(reader, "llama.rope.scaling.factor"))}
    raise ValueError(f"rope scaling type {kind!r} is not supported (only linear)")


def _eos_ids(reader: Any) -> int | list[int] | None:
    """HF's eos_token_id: the eos token plus end-of-turn/-message tokens where they differ."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tok = _field(reader, f"tokenizer.ggml.{key}", None)
        if tok is not None and int(tok) not in ids:
            ids.append(int(tok))
    return None if not ids else ids[0] if len(ids) == 1 else ids
