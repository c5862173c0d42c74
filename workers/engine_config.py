"""The engine's configuration, built once and passed down, and the check of it that needs the
model (the context: the model's, and what the pool holds). The memory the pool and the host
tier need is checked against the machine's in memory_room.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.workers.memory_size import memory_setting
from kvmesh.workers.tier_config import DEFAULT_DISK_CACHE_SIZE, TierConfig, check_disk_cache_size

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
# Names, not torch dtypes: a Serve replica builds and checks configs without loading torch
# (~1.4 s of import at every replica's start here); torch loads where a dtype is resolved.
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    block_size: int = 16
    kv_cache_memory: str | int = "1GiB"  # ignored when num_kv_blocks is given
    num_kv_blocks: int | None = None
    device: str | None = None  # None: CUDA when available, else CPU
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    # The KV cache's element type: "auto" (the model's dtype) or one of float32, bfloat16,
    # float16. A 16-bit cache under a float32 model holds twice the tokens in the same
    # memory and moves half the bytes (attention reads, pulls, tiers), for K/V rounded once.
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None  # "torch", "flash", or None for automatic
    max_num_seqs: int = 64
    # Prefill chunk size too. Small chunks let a request hit the prefix that another request
    # computed one step earlier, instead of computing it again in the same step.
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # float32 on CPU: batches of <= 32 rows (decode) multiply a GGUF's Q4_0/Q4_1/Q8_0 blocks
    # as stored instead of its float32 copy (workers/qmatmul.py); same values, ~6x fewer bytes.
    quantized_matmul: bool = True
    seed: int = 0  # seeds requests that bring no seed of their own
    # Tiers for blocks the pool evicts (workers/kv_tiers.py): host memory, then local disk
    # (files under disk_cache_dir/<fingerprint id>/, kept across restarts). 0 / None: off.
    host_cache_memory: str | int = 0
    disk_cache_dir: str | None = None
    disk_cache_size: str | int | None = None  # with disk_cache_dir; None: the default
    progress: bool = True  # a progress bar while weights load

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: must be an integer >= 1, got {self.block_size!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {self.num_kv_blocks}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be auto or one of {sorted(_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if (
            self.attention_backend == "flash"
            and self.resolved_kv_cache_dtype != self.resolved_dtype
        ):
            raise ValueError(
                "kv_cache_dtype: the flash attention backend needs the model's dtype "
                f"({str(self.resolved_dtype).removeprefix('torch.')}); use the torch backend"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        memory_setting("kv_cache_memory", self.kv_cache_memory)
        _ = self.tier_config  # validates the tier settings

    @property
    def tier_config(self) -> TierConfig:
        """The tiers' byte budgets (ValueError naming the setting when one is wrong)."""
        check_disk_cache_size(self.disk_cache_size, self.disk_cache_dir)
        disk_size = self.disk_cache_size
        host_bytes = memory_setting("host_cache_memory", self.host_cache_memory)
        disk_bytes = memory_setting(
            "disk_cache_size", DEFAULT_DISK_CACHE_SIZE if disk_size is None else disk_size
        )
        if self.disk_cache_dir is not None and not (
            isinstance(self.disk_cache_dir, str) and self.disk_cache_dir
        ):
            raise ValueError(f"disk_cache_dir: must be a path, got {self.disk_cache_dir!r}")
        return TierConfig(
            host_bytes=host_bytes,
            disk_dir=self.disk_cache_dir,
            disk_bytes=disk_bytes if self.disk_cache_dir else 0,
        )

    @property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype is not None:
            return getattr(torch, self.dtype)
        return torch.bfloat16 if self.resolved_device.startswith("cuda") else torch.float32

    @property
    def resolved_kv_cache_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return self.resolved_dtype
        import torch

        return getattr(torch, self.kv_cache_dtype)


def context_len(config: EngineConfig, model_len: int, num_blocks: int) -> int:
    """One request's context: ``max_model_len`` (default: the model's), at most what the pool
    holds. A pool too small for the model's context caps the default, with a warning, so
    requests without ``max_tokens`` still fit (as clients read it from /v1/models); an
    explicit ``max_model_len`` the pool cannot hold, or past the model's context, is refused,
    as vLLM does."""
    if config.max_model_len is not None and config.max_model_len > model_len:
        # As vLLM refuses it: positions past the model's were never trained.
        raise ValueError(
            f"max_model_len: {config.max_model_len} is more than the model's context of "
            f"{model_len} tokens; lower it or leave it out"
        )
    pool_tokens = num_blocks * config.block_size
    wanted = config.max_model_len or model_len
    if wanted <= pool_tokens:
        return wanted
    if config.max_model_len is not None:
        raise ValueError(
            f"max_model_len: {wanted} tokens do not fit in the KV cache, which holds "
            f"{pool_tokens} ({num_blocks} blocks of {config.block_size}); raise "
            "kv_cache_memory or lower max_model_len"
        )
    logger.warning(
        "the KV cache holds %d tokens, less than the model's context of %d: serving a "
        "context of %d (raise kv_cache_memory for more)",
        pool_tokens,
        wanted,
        pool_tokens,
    )
    return pool_tokens


def usable_device(name: str) -> torch.device:
    """``name`` (``EngineConfig.resolved_device``) as a device this process can run on;
    ValueError naming ``device`` when it cannot, rather than torch's assertion deep in the
    model's load (a CUDA device asked of a torch without CUDA) or its list of every device
    type it knows."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device: kvmesh runs on cpu or cuda, got {name!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = "no CUDA device is visible" if torch.version.cuda else "this torch has no CUDA"
        raise ValueError(f"device: {name!r}, but {why}; use cpu")
    if device.index is not None and device.index >= count:
        raise ValueError(f"device: {name!r}, but this process sees {count} CUDA device(s)")
    return device
