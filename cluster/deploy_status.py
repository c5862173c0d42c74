"""What Serve says of the kvmesh app while it comes up: the cause a failed replica raised, and
whether that is a refusal of its settings (which Serve's retries would only repeat)."""

from __future__ import annotations

from typing import Any

# Serve's deployment message while it retries a replica that failed to start.
RETRYING = "A replica failed to start"
# What a replica raises when the engine refuses its settings: starting it again repeats it.
REFUSED = "ValueError: "
# How often a deployment coming up is checked for such a refusal.
REFUSAL_CHECK_S = 0.5


def app_status(app_name: str) -> Any:
    from ray import serve

    try:
        return serve.status().applications.get(app_name)
    except Exception:  # the controller may be gone too: say what is known
        return None


def replica_cause(deployment: Any) -> str:
    """The exception a deployment's replica raised, from the last line of Serve's message."""
    lines = [ln.strip() for ln in (deployment.message or "").splitlines() if ln.strip()]
    return lines[-1].removeprefix("ray.exceptions.") if lines else "see the Serve logs"


def deploy_failure(app_name: str) -> str:
    """What Serve recorded about a failed deployment of ``app_name``: the exception the
    first failed deployment's replica raised, else Serve's own message."""
    app = app_status(app_name)
    if app is None:
        return "the deployment failed (see the Serve logs)"
    for name, deployment in app.deployments.items():
        if str(deployment.status).endswith("DEPLOY_FAILED") and deployment.message:
            return f"{name} failed to start: {replica_cause(deployment)}"
    return (app.message or "the deployment failed").splitlines()[0]


def refused_start(app: Any) -> str | None:
    """A replica of ``app`` (Serve's ``ApplicationStatusOverview``) failed to start because
    the engine refused its settings (a ``ValueError``: a context the pool cannot hold, an
    unknown model): what to report, else None. Serve would start it twice more per replica
    (a model load each, minutes for a large model) to the same end; any other error (a lost
    node, a timeout) is left to its retries."""
    for name, deployment in app.deployments.items():
        cause = replica_cause(deployment)
        if (deployment.message or "").startswith(RETRYING) and cause.startswith(REFUSED):
            return f"{name} failed to start: {cause}"
    return None
