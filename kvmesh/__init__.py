"""kvmesh: an LLM serving cluster on Ray whose workers share paged KV blocks.

``LLM``, ``SamplingParams`` and ``StructuredOutputsParams`` import torch, so they load on
first use: ``kvmesh --version`` and the bookkeeping modules stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]

if TYPE_CHECKING:
    from kvmesh.workers.llm import LLM
    from kvmesh.workers.sampling_params import SamplingParams
    from kvmesh.workers.structured_output import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvmesh.workers.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvmesh.workers.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from kvmesh.workers.structured_output import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")
