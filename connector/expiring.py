"""Names remembered for a while: the workers an ingress lost calls on, the holders a
worker's loader saw leave a pin unanswered. Both pass over a peer that stopped answering
until it has had time to come back or be replaced, and both forget it on their own (the
ingress sooner, once the worker answers a probe)."""

from __future__ import annotations

import time


class Expiring:
    """Names, each kept for ``ttl_s`` after its latest ``add``. The mapping is replaced
    whole, never mutated, so one thread may add while others read without a lock."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._until: dict[str, float] = {}

    def add(self, name: str) -> None:
        now = time.monotonic()
        kept = {n: t for n, t in self._until.items() if t > now and n != name}
        self._until = {**kept, name: now + self.ttl_s}

    def discard(self, name: str) -> None:
        """Forget ``name`` before its time (it answers again)."""
        if name in self._until:
            self._until = {n: t for n, t in self._until.items() if n != name}

    def __contains__(self, name: object) -> bool:
        until = self._until.get(name)  # type: ignore[call-overload]
        return until is not None and time.monotonic() < until

    def members(self) -> tuple[str, ...]:
        """The names kept now, in the order of their latest ``add``."""
        now = time.monotonic()
        return tuple(n for n, t in self._until.items() if t > now)
