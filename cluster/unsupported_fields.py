"""OpenAI request fields kvmesh does not implement (JSON mode, tools, ``best_of``, ...):
accepted only at a value that asks for nothing, else a 400 naming the field, as vLLM answers,
rather than an answer that silently is not what was asked for. Their JSON schema declares
just the accepted values, so a client (or a fuzzer) that follows it is answered. The request
models (``protocol.py``) declare the fields and list them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import WithJsonSchema

from kvmesh.cluster.api_error import ApiError


@dataclass(frozen=True)
class Unsupported:
    """An OpenAI field kvmesh does not implement: accepted only when ``is_off(value)`` (a value
    that asks for nothing), else a 400 saying so. The field's type and range are pydantic's
    to check, so a wrong type or an out-of-range value gets that 400 instead."""

    what: str  # what the field asks for, as the message names it
    accepted: str  # the values that ask for nothing, as the message names them
    is_off: Callable[[Any], bool]

    def error(self, field: str) -> ApiError:
        return ApiError(
            400,
            f"{field}: kvmesh does not support {self.what}; send {self.accepted} or leave it out",
            param=field,
        )


def only(*accepted: dict[str, Any]) -> WithJsonSchema:
    """The JSON schema of a field kvmesh does not implement: just the values it accepts (those
    that ask for nothing) or null, so what follows the schema is answered."""
    return WithJsonSchema({"anyOf": [*accepted, {"type": "null"}]})


def is_empty(v: Any) -> bool:  # null, {} or []
    return not v


def is_none_choice(v: Any) -> bool:
    return v is None or v == "none"


EmptyList = Annotated[list[dict[str, Any]] | None, only({"type": "array", "maxItems": 0})]
NoneChoice = Annotated[str | dict[str, Any] | None, only({"const": "none"})]


def unsupported_doc(accepted: str, extra: str = "") -> str:
    """The description of a field kvmesh does not implement, accepted only as ``accepted``."""
    return f"Not supported by kvmesh: only {accepted} or null is accepted, else a 400.{extra}"
