"""`kvmesh serve`: join a running Ray cluster (or start a local one), deploy, serve, stop.

Ctrl-C, SIGTERM or SIGHUP deletes the app and, when this process started them and nothing
else runs on them, shuts Serve and Ray down: no Ray process is left behind, and another
app on a shared cluster is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.deploy_status import REFUSAL_CHECK_S, app_status, deploy_failure, refused_start
from kvmesh.cluster.stop_signals import Interrupted, StopSignals
from kvmesh.cluster.tls import check_tls_files
from kvmesh.workers.tokenizer_loader import model_source

logger = logging.getLogger(__name__)


def connect_ray(config: ServeConfig, address: str = "auto") -> bool:
    """Join the cluster at ``address`` and return False, or start a local one and return True.

    ``auto`` joins the cluster this machine runs (``RAY_ADDRESS``, else the one ``ray start``
    recorded) and starts a local one only when none answers; an explicit address never falls
    back (a typo must not silently serve from a one-machine cluster); ``local`` always starts
    a new one. Ray 2.60 turns token authentication on: a driver joining a head started with
    ``ray start`` must say so, so joining sets ``RAY_AUTH_MODE=token`` when a token is set
    here (``auth_token_available``).
    """
    token = auth_token_available()
    if address != "local" and token:
        # Before Ray's first import: its core reads the mode once, when it loads.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if address != "local":
        if address != "auto":
            _check_answers(address)
        try:
            ray.init(address=address, log_to_driver=False)
            return False
        except ConnectionError as e:
            if address != "auto":
                # Something listens there (``_check_answers``): a head that wants a token
                # refuses a driver without one so, after ~20 s of Ray's retries.
                why = f"could not join the Ray cluster at {address}: {NO_TOKEN_HINT}"
                if token:
                    why = f"no Ray cluster answers at {address}"
                raise ConnectionError(f"address: {why}") from e
            logger.info("no running Ray cluster found; starting a local one")
    workers = config.num_unified_workers + config.prefill_workers + config.decode_workers
    # Logical CPUs: every worker gets its share even on a small machine.
    cpus = max(os.cpu_count() or 1, int(workers * config.num_cpus_per_worker) + 1)
    # The workers and Serve's proxy will run on this machine: a model that is not here, or a
    # port in use, fails now, not after Ray's and Serve's starts (on a cluster joined, the
    # model's path is the nodes' business).
    model_source(config.model)
    check_port_free(config)
    # address="local": a stale RAY_ADDRESS or /tmp/ray/ray_current_cluster is not joined.
    with _own_process_group():
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


# Where Ray 2.60 looks for a cluster's auth token, in its order.
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_PATH = "~/.ray/auth_token"
NO_TOKEN_HINT = (
    f"no auth token is set here, and a Ray head started with `ray start` needs its token: copy "
    f"the head's {DEFAULT_TOKEN_PATH} here, or set {TOKEN_PATH_ENV} or {TOKEN_ENV}"
)


def auth_token_available() -> bool:
    """Whether this process has a Ray auth token: ``RAY_AUTH_TOKEN``, the file
    ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token`` (an operator hands a cluster's
    token to its machines any of these ways)."""
    if os.environ.get(TOKEN_ENV, "").strip():
        return True
    path = os.environ.get(TOKEN_PATH_ENV) or os.path.expanduser(DEFAULT_TOKEN_PATH)
    return os.path.isfile(path)


@contextlib.contextmanager
def _own_process_group() -> Iterator[None]:
    """The local Ray's processes (its GCS, raylet, and the agents the raylet starts) run in a
    process group of their own. A closed terminal (SIGHUP), ``kill -TERM -PGID`` and
    ``timeout`` signal this command's whole process group: they reached the GCS and raylet
    too, which died at once, so the teardown found no Ray to drain and hung until Ray's
    driver gave up on its GCS after 60 s and ended the process. Ray's processes still die
    with this one (Ray's fate-sharing: the kernel's parent-death signal), Ray's workers start
    in process groups of their own already, and Ray stops them itself with SIGTERM and
    SIGKILL to each. (Ray does the same on Windows, where its processes get a new process
    group whenever the kernel shares their fate.)"""
    from ray._private import services

    popen = getattr(services, "ConsolePopen", None)
    if popen is None:  # another Ray: its processes share this group, as before
        yield
        return

    class OwnGroupPopen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


def _check_answers(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast when nothing listens at a ``host:port`` address: Ray itself retries a GCS
    that does not answer for minutes, logging, and never gives up (``ray://`` addresses and
    anything not ``host:port`` are left to Ray)."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError, OverflowError):
        raise ConnectionError(f"address: no Ray cluster answers at {address}") from None


class DeployFailed(RuntimeError):
    """The app did not come up; the message is the cause a replica gave, without traceback."""


class ClusterTaken(RuntimeError):
    """What this command would deploy collides with what Serve already runs on the cluster."""


# An app in these states is someone's running deployment; a failed or deleting one is not.
_LIVE_APP_STATES = ("DEPLOYING", "RUNNING", "UNHEALTHY")


def serve_details() -> Any:
    """The running Serve's ``ServeInstanceDetails`` (None: Serve does not run). Serve's
    client is the one way to read its HTTP options and user configs without starting it."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else ServeInstanceDetails(**client.get_serve_details())


def app_owner(details: Any) -> str | None:
    """Who deployed the cluster's kvmesh app (its ingress's user_config), if one runs."""
    from kvmesh.cluster.serve_app import APP_NAME, INGRESS_DEPLOYMENT

    app = details.applications.get(APP_NAME) if details is not None else None
    ingress = app.deployments.get(INGRESS_DEPLOYMENT) if app is not None else None
    user_config = ingress.deployment_config.user_config if ingress is not None else None
    return (user_config or {}).get("owner")


def new_owner() -> str:
    """This command's name as an app's owner: unique, and telling an operator where it runs."""
    return f"`kvmesh serve` pid {os.getpid()} on {socket.gethostname()} at {time.ctime()}"


def check_serve_free(config: ServeConfig, replace: bool = False) -> bool:
    """Refuse, before deploying, what Serve would otherwise do silently on a shared cluster:
    replace a running kvmesh app (another `kvmesh serve`'s), or ignore our host and port
    (Serve has one HTTP address per cluster; a later ``serve.start`` only logs that it
    differs). Returns whether Serve was already running."""
    from kvmesh.cluster.serve_app import APP_NAME

    details = serve_details()
    if details is None:
        return False
    for name, app in details.applications.items():
        if str(app.status).rsplit(".", 1)[-1] not in _LIVE_APP_STATES:
            continue
        if name == APP_NAME and not replace:
            by = app_owner(details) or "another deployment"
            raise ClusterTaken(
                f"this Ray cluster already runs a kvmesh app, deployed by {by}; stop that "
                "first, or pass --replace to replace it"
            )
        if name != APP_NAME and app.route_prefix == "/":
            raise ClusterTaken(f"the Serve app {name!r} already serves route / on this cluster")
    check_serve_http(config, details)
    return True


def check_serve_http(config: ServeConfig, details: Any) -> None:
    """Refuse a config whose HTTP address or TLS files differ from those of the Serve that
    runs (``details``; None: none runs): Serve has one HTTP setup per cluster, and a later
    ``serve.start`` only logs that it ignores ours, so the app would be served at another
    address, or over plain HTTP where HTTPS was asked for."""
    http = details.http_options if details is not None else None
    if http is None:
        return
    if (http.host, http.port) != (config.host, config.port):
        raise ClusterTaken(
            f"Serve on this cluster listens on {http.host}:{http.port} (one HTTP address per "
            f"cluster); pass --host {http.host} --port {http.port}"
        )
    if (http.ssl_certfile, http.ssl_keyfile) != (config.ssl_certfile, config.ssl_keyfile):
        theirs = f"HTTPS with {http.ssl_certfile}" if http.ssl_certfile else "plain HTTP"
        raise ClusterTaken(
            f"Serve on this cluster serves {theirs} (one HTTP setup per cluster); pass the "
            "same --ssl-certfile and --ssl-keyfile, or none"
        )


def _port_in_use(config: ServeConfig) -> DeployFailed:
    return DeployFailed(
        f"port: {config.host}:{config.port} is in use (Serve's HTTP proxy could not bind it); "
        "pass another --port"
    )


def check_port_free(config: ServeConfig) -> None:
    """Bind the HTTP address as Serve's proxy (uvicorn, with SO_REUSEADDR) would, and let it
    go, before starting a local Ray (whose Serve proxy binds on this machine): a port in use,
    or a host that is no address of this machine, fails in a moment instead of after Ray's
    and Serve's starts."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((config.host, config.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _port_in_use(config) from None
            # Else the host is no address of this machine (or the port needs privileges):
            # Serve's proxy would fail the same way after Ray's start, and say "bind" only.
            hint = "pass an address of this machine (0.0.0.0: all of them)"
            field = "host"
            if e.errno == errno.EACCES:
                field, hint = "port", "pass a port from 1024 up, or run with the privilege"
            raise DeployFailed(
                f"{field}: cannot listen on {config.host}:{config.port} here "
                f"({e.strerror or e}); {hint}"
            ) from None


def stop_serving(started_serve: bool, owner: str) -> None:
    """Delete the kvmesh app if ``owner`` deployed it, and shut Serve down only when this
    command started it and no other app runs on it: another tenant's app, or a
    ``--replace`` that took ours over, survives our stop."""
    from ray import serve

    from kvmesh.cluster.serve_app import APP_NAME

    details = serve_details()
    if details is None:
        return
    now = app_owner(details)
    if now == owner:
        serve.delete(APP_NAME)
        remove_index_actors()
    elif now is not None:
        print(f"kvmesh: the app is now {now}'s (--replace); left it running", flush=True)
    if started_serve and not serve.status().applications:
        serve.shutdown()


def remove_index_actors() -> None:
    """End the cluster's kvmesh index actors, once its kvmesh app (a cluster runs one) is
    deleted: detached so that they outlive the workers that create them, they would outlive
    the app too, an idle process per model on a cluster that outlives ``kvmesh serve``. A
    later app's workers create their index again."""
    import ray

    from kvmesh.connector.index_actor import ACTOR_NAME_PREFIX

    try:
        named = ray.util.list_named_actors(all_namespaces=True)
    except Exception as e:  # the stop goes on: an idle index is no reason to fail it
        logger.warning("kvmesh: could not list the index actors to end them: %s", e)
        return
    for actor in named:
        if actor["name"].startswith(ACTOR_NAME_PREFIX):
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(actor["name"], actor["namespace"]), no_restart=True)


def serve_forever(config: ServeConfig, address: str = "auto", replace: bool = False) -> None:
    """Deploy and serve until Ctrl-C, SIGTERM or SIGHUP (a closed terminal). Each also stops
    a deployment that is still coming up (e.g. waiting for resources that never appear); a
    deployment that fails raises ``DeployFailed`` naming the replica's error, at the first
    replica whose engine refused its settings (``refused_start``); one that would collide
    with what the cluster's Serve runs raises ``ClusterTaken`` before deploying."""
    check_tls_files(config)  # before a local Ray starts (deploy checks again: a millisecond)
    started_ray = connect_ray(config, address)  # it sets Ray's auth mode before Ray's import
    import ray

    from kvmesh.cluster.serve_app import APP_NAME, deploy

    signals = StopSignals()
    try:
        serve_was_running = check_serve_free(config, replace)
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    owner = new_owner()
    signals.install()
    refused: list[str] = []
    up = threading.Lock()  # held to decide, at once, that the app is up or is refused
    came_up = False

    def watch_start() -> None:
        """While the app comes up, stop the wait (as a signal does) once a replica's start
        is refused: then ``DeployFailed`` names the refusal."""
        while signals.interrupting:
            time.sleep(REFUSAL_CHECK_S)
            app = app_status(APP_NAME)
            error = refused_start(app) if app is not None else None
            with up:
                if error is not None and signals.interrupting:
                    refused.append(error)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

    try:
        signals.interrupt()  # serve.run waits for the replicas: a signal cuts the wait
        threading.Thread(target=watch_start, name="kvmesh-start-watch", daemon=True).start()
        try:
            deploy(config, owner)
        except RuntimeError as e:
            if "Failed to bind to address" in str(e):  # Serve's proxy, in a RayTaskError
                raise DeployFailed(
                    f"port: Serve's HTTP proxy could not listen on {config.host}:{config.port} "
                    "(the port is in use, or the host is no address of the proxy's node); "
                    "pass another --port or --host"
                ) from None
            if "Deploying application" not in str(e):
                raise
            raise DeployFailed(deploy_failure(APP_NAME)) from None
        with up:
            signals.interrupting = False
            came_up = True
        print(
            f"kvmesh: serving {config.model_name} on {config.base_url}",
            flush=True,
        )
        signals.wait()
    except Interrupted:  # asked to stop while deploying: a clean stop, as after it
        pass
    finally:
        signals.interrupting = False  # a second signal must not cut the teardown
        print(
            f"kvmesh: shutting down (running requests get up to {config.drain_timeout_s:g} s:"
            " --drain-timeout-s)",
            flush=True,
        )
        try:
            # An app that never came up has nothing to drain: with our own Ray, its shutdown
            # ends every replica at once (serve.delete waits ~30 s on pending ones).
            if came_up or not started_ray:
                # With our own Ray, its shutdown ends Serve: serve.shutdown would only add
                # Ray's alarming "(raylet) Task ServeController.graceful_shutdown failed"
                # line (the controller kills itself under infinite task retries).
                own_serve = not serve_was_running and not started_ray
                stop_serving(started_serve=own_serve, owner=owner)
        finally:
            if started_ray:
                ray.shutdown()
            signals.close()  # the stop is over: a later signal must not change the exit status
    if refused:
        raise DeployFailed(refused[0])
