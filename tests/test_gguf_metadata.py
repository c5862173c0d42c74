"""gguf_metadata.py against gguf's own reader, its errors on broken files, and the GGUF
tokenizer it feeds (tokenizer_loader.py) loading without torch. That tokenizer equals
transformers' own: test_loader.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.workers.gguf_metadata import read_metadata
from kvmesh.workers.tokenizer_loader import load_tokenizer, smollm2_gguf_path

KEEP = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def _reference(path: Path) -> dict[str, Any]:
    """gguf's GGUFReader's view of every metadata key, shaped as read_metadata answers: string
    arrays outside KEEP as their length."""
    out: dict[str, Any] = {}
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("GGUF."):  # the reader's own header pseudo-fields
            continue
        value = field.contents()
        strings = field.types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
        out[key] = len(value) if strings and key not in KEEP else value
    return out


def _finish(w: gguf.GGUFWriter) -> None:
    """Write the file: its metadata, then one tensor (which a metadata reader must skip)."""
    import numpy as np

    w.add_tensor("x", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write(path: Path) -> Path:
    """A GGUF with a value of every metadata type, and one tensor (which must be skipped)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60_000)
    w.add_int16("t.i16", -30_000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 🤗")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e300)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, -1.5])
    w.add_array("t.strs", ["a", "", "日本"])
    w.add_token_list(["<s>", "héllo", " "])
    _finish(w)
    return path


def test_every_value_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "types.gguf")
    ours = read_metadata(path, KEEP)
    assert ours == _reference(path)
    assert ours["t.str"] == "héllo 🤗" and ours["t.u64"] == 2**63 + 5 and ours["t.strs"] == 3
    assert ours["tokenizer.ggml.tokens"] == ["<s>", "héllo", " "]
    assert read_metadata(path)["tokenizer.ggml.tokens"] == 3  # not asked for: its length


@pytest.mark.real_model
def test_smollm2s_metadata_reads_as_gguf_reads_it() -> None:
    path = smollm2_gguf_path()
    ours = read_metadata(path, KEEP)
    assert ours == _reference(path)
    assert len(ours["tokenizer.ggml.tokens"]) == 49152 and ours["general.architecture"] == "llama"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a GGUF file"),
        (b"PK\x03\x04 a zip, not a model", "no GGUF magic"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "GGUF version 1"),
        (b"GGUF" + (3).to_bytes(4, "little"), "truncated or corrupt"),
    ],
)
def test_a_broken_file_is_a_clear_error(tmp_path: Path, data: bytes, message: str) -> None:
    (tmp_path / "x.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=message):
        read_metadata(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match=r"x\.gguf"):  # what an ingress replica would start with
        load_tokenizer(str(tmp_path / "x.gguf"))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(min_value=1, max_value=10_000))
def test_a_file_cut_anywhere_in_its_metadata_is_a_clear_error(tmp_path: Path, cut: int) -> None:
    data = _write(tmp_path / "whole.gguf").read_bytes()
    kv_end = data.index(b"x\x01\x00\x00\x00") - 8  # where the tensor table ("x", 1 dim) starts
    (tmp_path / "cut.gguf").write_bytes(data[: min(cut, kv_end - 1)])
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        read_metadata(tmp_path / "cut.gguf", KEEP)


def test_a_sentencepiece_gguf_tokenizer_equals_transformers_own(tmp_path: Path) -> None:
    """A llama (sentencepiece) vocabulary, whose BOS llama.cpp adds unless the file says
    otherwise: the branch smollm2's byte-level BPE does not take (that one: test_loader.py)."""
    from transformers import PreTrainedTokenizerFast

    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc"]
    w = gguf.GGUFWriter(tmp_path / "spm.gguf", "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -1.5, -1.2, -0.5, -1.3])
    w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    _finish(w)
    ours = load_tokenizer(str(tmp_path / "spm.gguf"))
    ref = PreTrainedTokenizerFast.from_pretrained(
        str(tmp_path), gguf_file="spm.gguf", local_files_only=True
    )
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    for text in ["ab abc", " a b", "cab", ""]:
        assert ours(text).input_ids == ref(text).input_ids
    assert ours("ab").input_ids[0] == 1  # BOS added
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")
    assert ours.chat_template == ref.chat_template


@pytest.mark.parametrize("bos", ["past the vocabulary", "a float"])
def test_a_corrupt_special_token_id_names_no_token(tmp_path: Path, bos: str) -> None:
    """A BOS id past the vocabulary (transformers' own loader: an IndexError) or stored as a
    float (before: a TypeError, not the loader's ValueError) leaves BOS unset."""

    w = gguf.GGUFWriter(tmp_path / "odd.gguf", "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab", "<|end|>"])
    w.add_token_merges(["a b"])
    w.add_token_types([1, 1, 1, 3])
    if bos == "a float":
        w.add_float32("tokenizer.ggml.bos_token_id", 1.0)
    else:
        w.add_bos_token_id(10**6)
    w.add_eos_token_id(3)
    _finish(w)
    tok = load_tokenizer(str(tmp_path / "odd.gguf"))
    assert tok.bos_token is None and tok.eos_token == "<|end|>"
    assert tok("ab").input_ids == [2]


@pytest.mark.real_model
def test_a_gguf_tokenizer_loads_without_torch() -> None:
    """What an ingress replica of the default model does at its start: before, transformers'
    GGUF reader imported torch (3.1 -> 1.9 s and 370 -> 204 MB max RSS for the
    ingress module and the tokenizer here)."""
    code = (
        "import sys; import kvmesh.cluster.frontend; "
        "from kvmesh.workers.tokenizer_loader import load_tokenizer; "
        "t = load_tokenizer('smollm2-135m'); "
        "print(len(t), t.eos_token, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["49152", "<|im_end|>", "False"]
