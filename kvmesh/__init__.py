"""kvmesh: an LLM serving cluster on Ray whose workers share paged KV blocks."""

__version__ = "0.1.0"
