"""``TransferFaults``: which transfer faults to inject and how often (see fault_transport.py),
apart from the transport that injects them, so a config that carries them loads no torch."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

ENV_VAR = "KVMESH_FAULT_TRANSPORT"
KINDS = ("fail", "timeout", "partial", "late")


@dataclass(frozen=True)
class TransferFaults:
    """Per-read probabilities of each fault kind (they add up to at most 1) and the seed."""

    fail_rate: float = 0.0
    timeout_rate: float = 0.0
    partial_rate: float = 0.0
    seed: int = 0
    late_rate: float = 0.0
    late_after_s: float = 0.2  # how long after the timeout a ``late`` read's bytes land

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "seed":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"seed: must be an int, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{f.name}: must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name}: must be finite and >= 0, got {value!r}")
        if any(r > 1 for r in self.rates.values()) or sum(self.rates.values()) > 1 + 1e-9:
            raise ValueError(f"fault rates must add up to at most 1, got {self.rates}")

    @property
    def rates(self) -> dict[str, float]:
        """Kind -> probability per read, in `KINDS` order."""
        return {kind: getattr(self, f"{kind}_rate") for kind in KINDS}

    @classmethod
    def parse(cls, spec: str) -> TransferFaults:
        """From ``field=value,...`` (the field names); ValueError for anything else."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for item in spec.split(","):
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or key not in names or key in kwargs:
                raise ValueError(
                    f"{ENV_VAR}: cannot parse {item.strip()!r} in {spec!r}; expected "
                    f"comma-separated field=value with fields {sorted(names)}"
                )
            try:
                kwargs[key] = int(raw) if key == "seed" else float(raw)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: {key}={raw!r} is not a number") from None
        return cls(**kwargs)

    @classmethod
    def from_env(cls) -> TransferFaults | None:
        """`KVMESH_FAULT_TRANSPORT` parsed, or None when it is unset or empty."""
        spec = os.environ.get(ENV_VAR, "").strip()
        return cls.parse(spec) if spec else None
