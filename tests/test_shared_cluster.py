"""`kvmesh serve` on a Ray cluster whose Serve already runs apps: it neither replaces a running
kvmesh app nor serves on an address other than the one it prints, and its stop deletes only
its own app. Before, a second `kvmesh serve` silently replaced the first (whose stop then
deleted the second's), printed a port Serve ignored, and a stop shut all of Serve down."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import trustme
from ray import serve

from kvmesh.cluster.launch import (
    ClusterTaken,
    app_owner,
    check_serve_free,
    serve_details,
    stop_serving,
)
from kvmesh.cluster.serve_app import APP_NAME, deploy
from kvmesh.connector.index_actor import ACTOR_NAME_PREFIX
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import SERVE_PORT, tiny_config, undeploy

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]

OTHER_APP = "someone-elses"
FIRST, SECOND = "`kvmesh serve` pid 1 on host-a", "`kvmesh serve` pid 2 on host-b"


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Hello:
    def __call__(self, request: object) -> str:
        return "hello"


@pytest.fixture(scope="module")
def two_apps() -> Iterator[None]:
    """A kvmesh app at / (deployed by FIRST) and another tenant's app at /other, on the
    session's Serve."""
    undeploy()
    deploy(tiny_config(), owner=FIRST)
    serve.run(Hello.bind(), name=OTHER_APP, route_prefix="/other")
    yield
    undeploy()
    serve.delete(OTHER_APP)


def other_app_answers() -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{SERVE_PORT}/other", timeout=10) as r:
        return r.read() == b"hello"


@pytest.mark.usefixtures("two_apps")
def test_a_second_kvmesh_serve_is_refused_unless_it_replaces() -> None:
    with pytest.raises(ClusterTaken, match=rf"kvmesh app, deployed by {FIRST}; .*--replace"):
        check_serve_free(tiny_config())
    assert check_serve_free(tiny_config(), replace=True) is True  # Serve was running


@pytest.mark.usefixtures("two_apps")
def test_a_port_serve_would_ignore_is_refused() -> None:
    with pytest.raises(ClusterTaken, match=f"listens on 127.0.0.1:{SERVE_PORT}.*--port"):
        check_serve_free(tiny_config(port=SERVE_PORT + 1), replace=True)


@pytest.mark.usefixtures("two_apps")
def test_https_that_serve_would_ignore_is_refused() -> None:
    """Serve runs plain HTTP here: asking for HTTPS would serve plain HTTP, silently."""
    tls = tiny_config(ssl_certfile="cert.pem", ssl_keyfile="key.pem")
    with pytest.raises(ClusterTaken, match=r"serves plain HTTP.*--ssl-certfile"):
        check_serve_free(tls, replace=True)


@pytest.mark.usefixtures("two_apps")
def test_deploy_refuses_an_address_or_https_serve_would_ignore(tmp_path: Path) -> None:
    """From Python too (before: Serve logged that it ignores the new HTTP options, at INFO,
    and the app was served on its old address, over plain HTTP where HTTPS was asked for);
    the running app is left as it was."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    files = {"ssl_certfile": str(tmp_path / "cert.pem"), "ssl_keyfile": str(tmp_path / "key.pem")}
    with pytest.raises(ClusterTaken, match=f"listens on 127.0.0.1:{SERVE_PORT}"):
        deploy(tiny_config(port=SERVE_PORT + 1), owner=SECOND)
    with pytest.raises(ClusterTaken, match="serves plain HTTP"):
        deploy(tiny_config(**files), owner=SECOND)
    assert app_owner(serve_details()) == FIRST


def index_actors() -> list[str]:
    """The kvmesh index actors alive in this Ray cluster."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if a["name"].startswith(ACTOR_NAME_PREFIX)]


@pytest.mark.usefixtures("two_apps")
def test_stop_deletes_only_its_own_app() -> None:
    # SECOND replaced FIRST's app (--replace): FIRST's stop leaves it, and Serve, running.
    deploy(tiny_config(), owner=SECOND)
    stop_serving(started_serve=True, owner=FIRST)
    assert APP_NAME in serve.status().applications
    assert index_actors()  # the running app's index, kept
    # SECOND's stop deletes it; the other tenant's app and Serve stay, although this stop
    # claims to have started Serve. Its index goes too: detached, it outlived the app before
    # (an idle process per model on a cluster that outlives `kvmesh serve`).
    stop_serving(started_serve=True, owner=SECOND)
    assert APP_NAME not in serve.status().applications
    assert index_actors() == []
    assert other_app_answers()
    assert check_serve_free(tiny_config()) is True  # and a new kvmesh serve may deploy
