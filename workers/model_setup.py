"""The model an engine runs: built on its device, moved onto whichever C kernels apply
(quantized matmuls, paged attention, RMSNorm and RoPE: cpu_kernels.py), and what those choices
make of the KV numbers, for the fingerprint (a worker whose numbers differ must never share a
block with this one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.workers.attention import get_attn_backend
from kvmesh.workers.cpu_attention import KERNEL_NUMERICS
from kvmesh.workers.cpu_kernels import kernel_library
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.loader import LoadedWeights
from kvmesh.workers.model import LlamaForCausalLM


@dataclass(frozen=True)
class BuiltModel:
    model: LlamaForCausalLM
    # How many weights small batches read as quantized blocks (0: float32 only).
    num_quantized_weights: int
    # The fingerprint's fields for what changes the numbers (ModelFingerprint's docs).
    attention: str
    rmsnorm: str


def build_model(
    config: EngineConfig,
    weights: LoadedWeights,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> BuiltModel:
    # Flash kernels read the cache in q's dtype (EngineConfig refuses "flash" with another
    # cache dtype); the torch backend widens a cache of another dtype as it reads it.
    backend_name = "torch" if kv_dtype != dtype else config.attention_backend
    backend = get_attn_backend(backend_name, device, dtype)
    model = LlamaForCausalLM(weights.config, backend)
    model.load_state_dict(weights.state_dict)
    model = model.to(device=device, dtype=dtype).eval()
    quantized = 0
    on_cpu_f32 = device.type == "cpu" and dtype == torch.float32
    if config.quantized_matmul and weights.quantized and on_cpu_f32 and kernel_library():
        quantized = model.use_quantized(weights.quantized)
    kernels = _cpu_kernels_on(backend, device, dtype)
    norm_kernel = kernels and model.use_cpu_kernels()
    name = type(backend).__name__
    return BuiltModel(
        model,
        quantized,
        attention=name + f"+cpu_kernel.v{KERNEL_NUMERICS}" if kernels else name,
        rmsnorm="cpu_kernel" if norm_kernel else "torch",
    )


def _cpu_kernels_on(backend: object, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the torch backend runs its rows through the C kernel (CPU, float32, the kernels
    built, and not turned off), as `TorchAttentionBackend` decides; the model's RMSNorm and
    RoPE take theirs exactly then too."""
    kernel = getattr(backend, "cpu_kernel", None)
    on_cpu_f32 = device.type == "cpu" and dtype == torch.float32
    return on_cpu_f32 and kernel is not False and (kernel or kernel_library() is not None)
