"""kvmesh's own log lines in a Serve replica go where Serve's go.

Ray's worker processes send the root logger to the process's stderr file (``worker-*.err``),
apart from the replica's Serve log (``logs/serve/replica_<app>_<deployment>_<id>.log``,
with the request id of each line, also what the dashboard shows). An operator reads the
latter, and ``kvmesh serve`` does not stream workers' output to its terminal, so a warning
such as a migration or a prefill that fell back would be found nowhere expected. Each
replica therefore hands the ``kvmesh`` loggers Serve's handlers and level
(``LoggingConfig.log_level``). The engine's ``WorkerActor`` is a plain actor: its lines stay
in its ``worker-*.err``.

Serve logs whatever a replica's method raises as an ERROR, "Request failed." with the
traceback. A handle call refused for what it is (``ApiError`` below 500: a bad body; Serve's
``BackPressureError``: over the admission limit) is the caller's error, not the server's:
``ClientErrorsAtInfo`` makes it one INFO line naming the status, so that an ERROR line still
means something broke (the HTTP routes answer such errors themselves and log nothing).
"""

from __future__ import annotations

import logging

from ray.serve.exceptions import BackPressureError

from kvmesh.cluster.api_error import ApiError

SERVE_LOGGER = "ray.serve"
KVMESH_LOGGER = "kvmesh"


class ClientErrorsAtInfo(logging.Filter):
    """A record whose exception is a client error becomes one INFO line: the status and
    message the caller got, without the traceback; any other record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        if isinstance(e, ApiError) and e.status < 500:
            status, message = e.status, e.body["error"]["message"]
        elif isinstance(e, BackPressureError):
            status, message = e.status_code, str(e)
        else:
            return True
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.msg, record.args = "%s Refused with %s: %s", (record.getMessage(), status, message)
        record.exc_info, record.exc_text = None, None
        return True


def log_like_serve() -> None:
    """Call in a replica's constructor (Serve has configured its logger by then)."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, ClientErrorsAtInfo) for f in serve_logger.filters):
        serve_logger.addFilter(ClientErrorsAtInfo())
    ours = logging.getLogger(KVMESH_LOGGER)
    ours.handlers = list(serve_logger.handlers)
    ours.setLevel(serve_logger.level)
    ours.propagate = not ours.handlers  # outside a replica: as before, to the root logger
