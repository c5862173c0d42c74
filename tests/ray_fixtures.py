"""One local Ray instance shared by every test that needs Ray (starting one costs seconds)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A local Ray (4 CPUs, no dashboard), started once per session and shut down at its end."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def actor_pid(actor: Any) -> int:
    """The process id of a Ray actor (to stop or kill it as a fault would)."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def torch_loaded(actor: Any) -> bool:
    """Whether a Ray actor's process has imported torch."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: "torch" in sys.modules), timeout=30)
