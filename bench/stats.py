"""Summary statistics the benches report, defined once so their rows compare."""

from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-quantile (0 < q <= 1) by nearest rank: a value that was measured, never an
    interpolation between two. None when there are no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
