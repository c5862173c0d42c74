"""Session-wide fixtures: one loaded model of each kind per test session."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class HFReference:
    """A transformers model with the same weights: greedy decoding by full recomputation."""

    def __init__(self, model: str) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        from kvmesh.workers.loader import load_weights

        weights = load_weights(model, progress=False)
        cfg = weights.config.to_hf_config()
        self.model = AutoModelForCausalLM.from_config(
            LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}),
            torch_dtype=torch.float32,
        ).eval()
        missing, unexpected = self.model.load_state_dict(weights.state_dict, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
        self.tokenizer = weights.tokenizer

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Float32 logits of the next token after ``ids``."""
        return self.model(torch.tensor([list(ids)])).logits[0, -1].float()

    def greedy(self, ids: Sequence[int], n: int) -> tuple[list[int], torch.Tensor]:
        """``n`` greedy tokens (EOS ignored) and the logits that chose the last one."""
        ids, out = list(ids), []
        for _ in range(n):
            logits = self.logits(ids)
            out.append(int(logits.argmax()))
            ids.append(out[-1])
        return out, logits


@pytest.fixture(scope="session")
def tiny_hf() -> HFReference:
    return HFReference("tiny-random")


@pytest.fixture(scope="session")
def smollm2_llm():
    """The default model in kvmesh's engine, loaded once per session."""
    from kvmesh import LLM

    return LLM("smollm2-135m", kv_cache_memory="256MiB", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own GGUF loader on the same file: an independent reference.

    transformers opens the file with a new ``gguf.GGUFReader`` three times (config, weights,
    tokenizer) and builds gguf's tensor-name map once per tensor (397 times): most of its
    ~35 s here. Both are pure functions of their arguments, so they are memoized while it loads;
    what transformers computes from them is unchanged.
    """
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmesh.workers.tokenizer_loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    kw = {"gguf_file": path.name, "local_files_only": True}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("GGUFReader", "get_tensor_name_map"):
            mp.setattr(gguf, name, functools.cache(getattr(gguf, name)))
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
        return model.eval(), AutoTokenizer.from_pretrained(path.parent, **kw)


# -- the OpenAI API over a LocalBackend (tests/test_openai_*.py) -------------------------------
# Imported inside the fixtures: the HF offline settings above must come before transformers.


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    from kvmesh.cluster.local_backend import LocalBackend
    from tests.openai_helpers import MAX_LEN, MODEL

    b = LocalBackend(
        model=MODEL, block_size=4, num_kv_blocks=128, max_model_len=MAX_LEN, progress=False
    )
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def server(backend: Any) -> Iterator[tuple[int, Any]]:
    from kvmesh.cluster.openai_api import build_api
    from tests.openai_helpers import MODEL, Spy, serve

    spy = Spy(backend)
    with serve(build_api(spy, model_name=MODEL)) as port:
        yield port, spy


@pytest.fixture
def client(server: tuple[int, Any]) -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="test", max_retries=0)
