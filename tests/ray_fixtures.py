"""One local Ray instance shared by every test that needs Ray (starting one costs seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A local Ray (4 CPUs, no dashboard), started once per session and shut down at its end."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()
