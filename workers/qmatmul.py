"""Matmuls over GGUF's quantized weight blocks (Q4_0, Q4_1, Q8_0), for small batches on CPU.

A CPU decode step streams every weight from memory once, so in float32 it is bound by memory
bandwidth: SmolLM2-135M is 538 MB of float32 but 97 MB as the Q4_1 / Q8_0 blocks its GGUF
stores. `qmatmul` multiplies float32 activations by those blocks, repacked by `pack` into
panels of 16 rows of the same size (csrc/qmatmul.c). Each weight is dequantized in registers
to exactly the float32 value `gguf` gives, and products are summed in float32, so results
differ from `F.linear` over the dequantized matrix only in summation order (~1e-6 relative).
It is as fast as MKL's float32 GEMM for large batches too (prefill: compute-bound; from 9 rows
the AVX2 build dequantizes each panel once and runs a GEMM's register tile over it, 82-86% of
the FMA peak on 2 Zen 3 cores against MKL's 75-81%), so a model that uses it drops the float32
copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.workers.cpu_kernels import require_library

# ggml type id -> bytes per 32-weight block.
BLOCK_BYTES: dict[int, int] = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0
BLOCK_WEIGHTS = 32


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [out_features, in_features] weight as GGUF stores it: `blocks` is uint8
    [out_features, in_features / 32 * BLOCK_BYTES[ggml_type]], one row of blocks per output
    row, in HF row order (the loader undoes llama.cpp's q/k row permutation on these too)."""

    ggml_type: int
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        bb = BLOCK_BYTES.get(self.ggml_type)
        if bb is None:
            raise ValueError(f"ggml_type: {self.ggml_type} has no quantized kernel")
        if self.in_features % BLOCK_WEIGHTS != 0:
            raise ValueError(f"in_features: {self.in_features} is not a multiple of 32")
        row = self.in_features // BLOCK_WEIGHTS * bb
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != row or not b.is_contiguous():
            got = f"{b.dtype} {tuple(b.shape)}"
            raise ValueError(f"blocks: expected contiguous uint8 [N, {row}], got {got}")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A QuantizedWeight repacked into qmatmul.c's 16-row panels (`pack`)."""

    ggml_type: int
    panels: torch.Tensor  # uint8, kvq_packed_bytes long
    out_features: int
    in_features: int


def pack(w: QuantizedWeight) -> PackedWeight:
    """The panel layout `qmatmul` reads (same bytes per weight as the GGUF blocks)."""
    lib = require_library()
    n, k = w.out_features, w.in_features
    panels = torch.empty(lib.kvq_packed_bytes(w.ggml_type, n, k), dtype=torch.uint8)
    rc = lib.kvq_repack(w.ggml_type, w.blocks.data_ptr(), n, k, panels.data_ptr())
    assert rc == 0, "QuantizedWeight validated type and shape"
    return PackedWeight(w.ggml_type, panels, n, k)


def fuse(ws: list[PackedWeight]) -> tuple[PackedWeight, list[PackedWeight]] | None:
    """One weight whose output rows are `ws`' rows back to back, so that projections of the
    same input (q/k/v, gate/up) take one kernel call; plus `ws` again as views into it (no
    second copy). None unless they share type and input size and each fills whole 16-row
    panels (then the panels simply concatenate)."""
    first = ws[0]
    if any(
        w.ggml_type != first.ggml_type or w.in_features != first.in_features or w.out_features % 16
        for w in ws
    ):
        return None
    panels = torch.cat([w.panels for w in ws])
    views, offset = [], 0
    for w in ws:
        views.append(PackedWeight(w.ggml_type, panels[offset : offset + len(w.panels)],
                                  w.out_features, w.in_features))  # fmt: skip
        offset += len(w.panels)
    fused = PackedWeight(
        first.ggml_type, panels, sum(w.out_features for w in ws), first.in_features
    )
    return fused, views


def qmatmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x float32 [M, K] (CPU) @ W^T -> float32 [M, N]."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"x: expected float32 [M, K] on CPU, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x: has {x.shape[1]} columns, the weight takes {w.in_features}")
    x = x.contiguous()
    m, n = x.shape[0], w.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    rc = require_library().kvq_matmul(
        w.ggml_type,
        x.data_ptr(),
        m,
        w.in_features,
        w.panels.data_ptr(),
        n,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    assert rc == 0, "PackedWeight came from pack()"
    return y


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 [N, K] weight as the kernel sees it: identity @ W^T through `qmatmul` itself
    (each output sums one 1 * w and zeros, which is exact), so it checks the kernel's own
    in-register dequantization against gguf's."""
    return qmatmul(torch.eye(w.in_features), pack(w)).T.contiguous()
