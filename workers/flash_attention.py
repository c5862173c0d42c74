"""`FlashAttentionBackend`: paged attention on CUDA through vllm-flash-attn (or flash-attn)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvmesh.workers.attention import AttentionBackend, AttentionMetadata, write_kv


class FlashAttentionBackend(AttentionBackend):
    """CUDA only: vllm-flash-attn's (or flash-attn's) varlen kernel reading K/V straight from the
    paged cache through block_table. The package is imported when the backend is built, never at
    module import. flash-attn upstream wants block_size % 256 == 0; vllm-flash-attn takes
    multiples of 16. Dtypes: fp16/bf16 only."""

    def __init__(self) -> None:
        try:
            from vllm_flash_attn import flash_attn_varlen_func
        except ImportError:
            try:
                from flash_attn import flash_attn_varlen_func
            except ImportError as e:
                raise ImportError(
                    "the flash attention backend needs vllm-flash-attn (pip install "
                    "'kvmesh[gpu]') or flash-attn"
                ) from e
        self._fn: Callable[..., torch.Tensor] = flash_attn_varlen_func
        params = inspect.signature(flash_attn_varlen_func).parameters
        # Newer vllm-flash-attn takes seqused_k with block_table (and forbids cu_seqlens_k then);
        # older kernels have no seqused_k, or one that cannot replace the required cu_seqlens_k.
        cu_k = params.get("cu_seqlens_k")
        self._uses_seqused_k = "seqused_k" in params and cu_k is not None and cu_k.default is None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"flash attention needs float16 or bfloat16, got {q.dtype}")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._uses_seqused_k:
            kv_len = {"seqused_k": meta.seq_lens}
        else:
            # Older kernels (vllm-flash-attn 2.6, flash-attn) take cumulative key lengths.
            if "cu_seqlens_k" not in meta.scratch:
                cu = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
                meta.scratch["cu_seqlens_k"] = cu
            kv_len = {"cu_seqlens_k": meta.scratch["cu_seqlens_k"]}
        return self._fn(
            q=q,
            k=k_cache,
            v=v_cache,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,  # bottom-right aligned: the new tokens are the last of each context
            block_table=meta.block_tables,
            **kv_len,
        )
