"""kvmesh's own log lines in a Serve replica go where Serve's go.

Ray's worker processes send the root logger to the process's stderr file (``worker-*.err``),
apart from the replica's Serve log (``logs/serve/replica_<app>_<deployment>_<id>.log``,
with the request id of each line, also what the dashboard shows). An operator reads the
latter, and ``kvmesh serve`` does not stream workers' output to its terminal, so a warning
such as a migration or a prefill that fell back would be found nowhere expected. Each
replica therefore hands the ``kvmesh`` loggers Serve's handlers and level
(``LoggingConfig.log_level``). The engine's ``WorkerActor`` is a plain actor: its lines stay
in its ``worker-*.err``.
"""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"
KVMESH_LOGGER = "kvmesh"


def log_like_serve() -> None:
    """Call in a replica's constructor (Serve has configured its logger by then)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    ours = logging.getLogger(KVMESH_LOGGER)
    ours.handlers = list(serve_logger.handlers)
    ours.setLevel(serve_logger.level)
    ours.propagate = not ours.handlers  # outside a replica: as before, to the root logger
