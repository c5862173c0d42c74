"""``kv_cache_dtype``: a 16-bit KV cache under a float32 model (tiny-random, no Ray)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_flags import add_serve_args, config_from_args
from kvmesh.cluster.worker_deployment import engine_config
from kvmesh.workers.engine_config import EngineConfig

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
PROMPT = list(range(5, 50))  # 45 tokens: two full blocks of 16, then 13


def engine(kv_cache_dtype: str) -> LLM:
    return LLM("tiny-random", kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype, progress=False)


@pytest.fixture(scope="module")
def f32() -> LLM:
    return engine("auto")


def test_a_16_bit_cache_holds_twice_the_blocks_under_its_own_fingerprint(f32: LLM) -> None:
    ours = engine("bfloat16").engine
    theirs = f32.engine
    assert ours.kv_cache.dtype == torch.bfloat16
    assert ours.kv_cache.num_blocks == 2 * theirs.kv_cache.num_blocks
    assert ours.kv_cache.block_bytes_all_layers * 2 == theirs.kv_cache.block_bytes_all_layers
    # Never shared with a float32 cache's blocks, nor with a bfloat16 model's.
    assert ours.fingerprint.id != theirs.fingerprint.id
    assert (ours.fingerprint.dtype, ours.fingerprint.compute_dtype) == ("bfloat16", "float32")
    assert ours.fingerprint.id != engine_fingerprint(dtype="bfloat16")


def engine_fingerprint(**kw: str) -> str:
    return LLM("tiny-random", num_kv_blocks=8, progress=False, **kw).engine.fingerprint.id


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_prefix_hit_answers_as_a_cold_prompt(kv_cache_dtype: str) -> None:
    # The cold prompt's first chunk attends over its own K/V, the hit over the cache's: both
    # must see the values as the cache holds them (before the fix the cold prefill used the
    # unrounded float32 K/V, and its logprobs differed by ~1e-4).
    cold = engine(kv_cache_dtype).generate([PROMPT], GREEDY)[0]
    warm = engine(kv_cache_dtype)
    warm.generate([PROMPT[:32] + [7] * 13], GREEDY)
    hit = warm.generate([PROMPT], GREEDY)[0]
    assert hit.metrics.num_local_hit_tokens == 32 and cold.metrics.num_local_hit_tokens == 0
    assert hit.token_ids == cold.token_ids
    for t, a, b in zip(hit.token_ids, hit.logprobs, cold.logprobs, strict=True):
        assert abs(a[t] - b[t]) < 1e-5, (t, a[t], b[t])


def test_a_16_bit_cache_answers_close_to_float32(f32: LLM) -> None:
    ref = f32.generate([PROMPT], GREEDY)[0]
    out = engine("bfloat16").generate([PROMPT], GREEDY)[0]
    assert out.token_ids == ref.token_ids
    for t, a, b in zip(out.token_ids, out.logprobs, ref.logprobs, strict=True):
        assert abs(a[t] - b[t]) < 0.05, (t, a[t], b[t])


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: must be auto or one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, float32"):
        ServeConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="dtype: must be one of float32"):
        ServeConfig(dtype="float64")
    # Flash kernels read the cache in the model's dtype: named before any weight loads.
    with pytest.raises(ValueError, match="flash attention backend needs the model's dtype"):
        LLM("tiny-random", num_kv_blocks=8, attention_backend="flash", kv_cache_dtype="float16")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    config = config_from_args(p.parse_args(["--kv-cache-dtype", "bfloat16"]))
    assert config.kv_cache_dtype == "bfloat16"
    assert engine_config(config).kv_cache_dtype == "bfloat16"  # what a worker replica builds
