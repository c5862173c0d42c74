"""Writing a GGUF file the way llama.cpp's converter does, for loader and kernel tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType

from kvmesh.workers.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES, permute_rope_rows
from kvmesh.workers.loader import LoadedWeights

Q8_0 = GGMLQuantizationType.Q8_0


def write_gguf(
    w: LoadedWeights, path: Path, qtype: Callable[[str], GGMLQuantizationType] = lambda _: Q8_0
) -> Path:
    """`w` as llama.cpp's converter would write it: GGUF names, q/k rows permuted, 2-D weights
    quantized (`qtype(hf_name)`, Q8_0 by default), and a byte-level gpt2 tokenizer (scores
    instead of an empty merges list)."""
    c, tok = w.hf_config, w.tokenizer
    to_gguf = {hf: g for g, hf in _GLOBAL_NAMES.items()}
    to_gguf |= {
        f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight"
        for i in range(c["num_hidden_layers"])
        for g, hf in _LAYER_NAMES.items()
    }
    wr = gguf.GGUFWriter(path, "llama")
    wr.add_context_length(c["max_position_embeddings"])
    wr.add_embedding_length(c["hidden_size"])
    wr.add_block_count(c["num_hidden_layers"])
    wr.add_feed_forward_length(c["intermediate_size"])
    wr.add_head_count(c["num_attention_heads"])
    wr.add_head_count_kv(c["num_key_value_heads"])
    wr.add_layer_norm_rms_eps(c["rms_norm_eps"])
    wr.add_rope_freq_base(c["rope_theta"])
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    wr.add_tokenizer_model("gpt2")
    wr.add_token_list(vocab)
    wr.add_token_types([1] * 256 + [3] * (len(vocab) - 256))  # normal bytes, control specials
    wr.add_token_scores([0.0] * len(vocab))
    wr.add_bos_token_id(c["bos_token_id"])
    wr.add_eos_token_id(c["eos_token_id"])
    wr.add_chat_template(tok.chat_template)
    for name, t in w.state_dict.items():
        if ".q_proj." in name:
            t = permute_rope_rows(t, c["num_attention_heads"])
        elif ".k_proj." in name:
            t = permute_rope_rows(t, c["num_key_value_heads"])
        a = t.numpy()
        if a.ndim == 2:
            qt = qtype(name)
            wr.add_tensor(to_gguf[name], gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            wr.add_tensor(to_gguf[name], a)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path
