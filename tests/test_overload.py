"""Overload: queues are bounded end to end, and the excess is refused at once.

The limit from the config and flags, a full server's 429 (OpenAI's body, Retry-After, the
schema), places per choice over HTTP, Serve's ``BackPressureError`` from a worker deployment
mapped to a 429 too, and the Serve app on real Ray under a burst far above its limit: every
answer is a 200 or a 429 with Retry-After, every admitted request gives the unloaded answer,
nothing hangs, and afterwards it serves normally. Admission as a unit: test_admission.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from kvmesh.cluster import front_door
from kvmesh.cluster.admission import ADMISSION_HEADER, Admission
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from kvmesh.cluster.serve_flags import add_serve_args, config_from_args
from kvmesh.cluster.worker_deployment import engine_config
from tests.openai_helpers import MODEL, Spy, call
from tests.openai_helpers import serve as serve_http
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import redeploy, tiny_config, undeploy, wait_for

TIMEOUT_S = 120.0  # a client's socket timeout: an answer later than this is a hang
_JSON = {"Content-Type": "application/json"}


@contextlib.contextmanager
def _open_stream(port: int, body: dict[str, Any]) -> Iterator[http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), _JSON)
        yield conn.getresponse()
    finally:
        conn.close()


def post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    """One completion over raw HTTP: (status, headers, JSON body or the streamed text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), _JSON)
        r = conn.getresponse()
        headers = {k.lower(): v for k, v in r.getheaders()}
        raw = r.read().decode()
    finally:
        conn.close()
    if r.status == 200 and body.get("stream"):
        return r.status, headers, _stream_text(raw)
    return r.status, headers, json.loads(raw)


def _stream_text(raw: str) -> str | dict[str, Any]:
    """The text of an SSE stream, or its error event's body."""
    text = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            return event
        text += [c["text"] for c in event["choices"]]
    return "".join(text)


def check_refusal(headers: dict[str, str], body: Any, retry_after_s: float) -> None:
    assert headers["retry-after"] == str(max(1, math.ceil(retry_after_s)))
    error = body["error"]
    assert (error["type"], error["code"]) == ("overloaded_error", "overloaded")
    assert "overloaded" in error["message"]


# -- the limit and the 429, without Ray ----------------------------------------------------------


def test_the_limit_is_the_workers_batch_share_plus_the_queue() -> None:
    assert ServeConfig(workers=3, max_num_seqs=8, max_queued_requests=5).admission_limit == 29
    # Autoscaled: the most replicas count; two ingress replicas split it (rounded up).
    scaled = ServeConfig(workers=1, max_workers=3, max_num_seqs=8, ingress_replicas=2)
    assert scaled.admission_limit == 12 + 64
    # Under P/D the decode workers hold the requests; a prefill holds one for a token.
    pd = ServeConfig(prefill_workers=4, decode_workers=2, max_num_seqs=8, max_queued_requests=0)
    assert pd.admission_limit == 16
    bad_settings = (
        {"max_queued_requests": -1},
        {"retry_after_s": 0.0},
        {"max_num_seqs": 0},
        {"max_model_len": 1},
    )
    for bad in bad_settings:
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServeConfig(**bad)  # type: ignore[arg-type]


def test_the_settings_come_from_flags_and_yaml(tmp_path: Any) -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_serve_args(p)
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text("max-queued-requests: 7\nretry_after_s: 4\n")
    config = config_from_args(p.parse_args(["--config", str(yaml_file)]))
    assert (config.max_queued_requests, config.retry_after_s) == (7, 4)
    flags = ["--config", str(yaml_file), "--max-queued-requests", "0", "--retry-after-s", "2.5"]
    config = config_from_args(p.parse_args([*flags, "--max-model-len", "256"]))
    assert (config.max_queued_requests, config.retry_after_s) == (0, 2.5)
    assert config.max_model_len == 256 and engine_config(config).max_model_len == 256
    assert engine_config(ServeConfig()).max_model_len is None  # the model's


@pytest.fixture(scope="module")
def local_backend() -> Iterator[LocalBackend]:
    backend = LocalBackend(model=MODEL, block_size=4, num_kv_blocks=128, progress=False)
    yield backend
    backend.shutdown()


def test_a_full_server_answers_429_at_once_and_health_stays_open(
    local_backend: LocalBackend,
) -> None:
    """Two streams hold the two places: a third request is refused at once (before its body
    is read), /health answers, and once the streams end requests get in again."""
    admission = Admission(2, retry_after_s=1.0)
    app = build_api(local_backend, model_name=MODEL, admission=admission)
    long = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
    with serve_http(app) as port:
        with (
            _open_stream(port, {**long, "stream": True}) as a,
            _open_stream(port, {**long, "stream": True}) as b,
        ):
            assert a.status == b.status == 200 and admission.admitted == 2
            a.readline(), b.readline()  # both streams are running
            status, headers, body = post(port, {**long, "max_tokens": 1})
            assert status == 429
            check_refusal(headers, body, 1.0)
            # Refused before the body is read: not even parsed.
            status, body = call(port, "POST", "/v1/completions", b"{not json")
            assert status == 429, body
            assert call(port, "GET", "/health") == (200, {"status": "ok"})
            assert call(port, "GET", "/v1/models")[0] == 200
            assert admission.refused == 2
        # The clients hung up: the engine aborts their requests and the places come back.
        wait_for(lambda: admission.admitted == 0, 30, "the places given back")
        status, _, body = post(port, {**long, "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_http_admission_counts_choices(local_backend: LocalBackend) -> None:
    """A stream holds one of 4 places: a request of 4 choices (n=2 over 2 prompts) does not
    fit and is refused, one of 3 does; the places come back when they end."""
    admission = Admission(4, retry_after_s=1.0)
    app = build_api(local_backend, model_name=MODEL, admission=admission)
    long = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
    short = {"model": MODEL, "max_tokens": 2, "ignore_eos": True}
    with serve_http(app) as port:
        with _open_stream(port, {**long, "stream": True}) as a:
            assert a.status == 200 and admission.admitted == 1
            a.readline()
            status, headers, body = post(port, {**short, "prompt": [[1, 2], [3, 4]], "n": 2})
            assert status == 429, body
            check_refusal(headers, body, 1.0)
            assert "4 choices" in body["error"]["message"], body
            with _open_stream(port, {**long, "n": 3, "stream": True}) as b:
                assert b.status == 200 and admission.admitted == 4
                assert post(port, {**short, "prompt": [1]})[0] == 429  # full
        wait_for(lambda: admission.admitted == 0, 30, "the places given back")
        # Alone, a request larger than the limit runs.
        status, _, body = post(port, {**short, "prompt": [1, 2], "n": 6})
        assert status == 200 and len(body["choices"]) == 6, body
        assert admission.admitted == 0 and admission.refused == 2


def test_the_schema_declares_the_429_and_its_retry_after(local_backend: LocalBackend) -> None:
    with_admission = build_api(local_backend, model_name=MODEL, admission=Admission(4))
    paths = with_admission.openapi()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        refusal = paths[path]["post"]["responses"]["429"]
        assert refusal["headers"]["Retry-After"]["required"] is True
        assert refusal["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert "429" not in paths["/v1/models"]["get"]["responses"]
    assert "429" not in paths["/health"]["get"]["responses"]
    without = build_api(local_backend, model_name=MODEL).openapi()["paths"]
    assert "429" not in without["/v1/completions"]["post"]["responses"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_worker_queue_is_a_429_not_a_500(local_backend: LocalBackend, stream: bool) -> None:
    """Ray Serve's BackPressureError (a worker deployment's max_queued_requests, raised in the
    ingress's handle; injected here) is a 429 with Retry-After, before or during a stream."""

    def full() -> BaseException:
        return BackPressureError(9, 8, status_code=429, retry_after_s=2.2)

    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 4, "ignore_eos": True}
    with serve_http(build_api(Spy(local_backend, fail=full), model_name=MODEL)) as port:
        status, headers, answer = post(port, {**body, "stream": stream})
        assert status == 429
        check_refusal(headers, answer, 3.0)
    # Headers sent already (a stream that lost its worker and found the queue full on its
    # way to another): the refusal is the stream's error event.
    spy = Spy(local_backend, fail=full, fail_after=1)
    with serve_http(build_api(spy, model_name=MODEL)) as port:
        status, _, answer = post(port, {**body, "stream": True})
        assert status == 200 and answer["error"]["code"] == "overloaded"


def test_a_worker_deployment_that_failed_to_deploy_is_a_503(local_backend: LocalBackend) -> None:
    from ray.serve._private.common import DeploymentID

    def gone() -> BaseException:
        return DeploymentUnavailableError(DeploymentID(name="kvmesh-worker", app_name="kvmesh"))

    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 4}
    with serve_http(build_api(Spy(local_backend, fail=gone), model_name=MODEL)) as port:
        status, _, answer = post(port, body)
    assert status == 503 and answer["error"]["code"] == "unavailable"
    assert "kvmesh-worker" not in answer["error"]["message"]  # no internals


# -- the Serve app under a burst (real Ray) ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_a_burst_far_above_the_limit_is_refused_fast_and_the_admitted_are_right() -> None:
    """1 worker running 2 sequences + 2 waiting = 4 admitted; 32 requests at once (half of
    them streams) over HTTP, then 16 through the handle."""
    config = tiny_config(
        workers=1, max_num_seqs=2, max_queued_requests=2, retry_after_s=2.0, max_model_len=64
    )
    assert config.admission_limit == 4
    handle = redeploy(config)
    assert not front_door.warn_if_missing()  # deploy() started Serve with the door
    port = config.port
    try:
        prompts = [[3 + i, 5 + i, 7 + i, 11 + i, 13] for i in range(8)]
        gen = {"model": config.model_name, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        reference = [post(port, {**gen, "prompt": p})[2]["choices"][0]["text"] for p in prompts]

        def one(i: int) -> tuple[int, dict[str, str], Any, int]:
            body = {**gen, "prompt": prompts[i % len(prompts)], "stream": i % 2 == 1}
            return (*post(port, body), i)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(one, range(32)))  # a hang raises a socket timeout here

        admitted = [a for a in answers if a[0] == 200]
        refused = [a for a in answers if a[0] == 429]
        assert len(admitted) + len(refused) == 32, [a[0] for a in answers]
        assert len(admitted) >= config.admission_limit and refused
        for _, headers, body, _ in refused:
            check_refusal(headers, body, config.retry_after_s)
        for _, _, body, i in admitted:
            text = body if isinstance(body, str) else body["choices"][0]["text"]
            assert text == reference[i % len(prompts)], (i, body)

        stats = wait_for(
            lambda: (s := handle.ingress_stats.remote().result())["admitted"] == 0 and s,
            10,
            "the ingress to give every place back",
        )
        # The ingress refused some (the 5th at once passes the door: its limit is 4 + its
        # spare of 8), the front door in Serve's proxy the rest, with the same 429, each
        # naming its own limit; the door takes the header naming the ingress's off every answer.
        said = [body["error"]["message"] for _, _, body, _ in refused]
        by_ingress = [m for m in said if m.startswith("server overloaded: 4 requests")]
        by_door = [m for m in said if m.startswith("server overloaded: 12 requests")]
        assert len(by_ingress) + len(by_door) == len(refused), said
        assert stats["limit"] == 4 and stats["refused"] == len(by_ingress) >= 1
        assert all(ADMISSION_HEADER.decode() not in headers for _, headers, _, _ in answers)

        # The handle shares the bound: Serve's BackPressureError for the excess.
        def by_handle(i: int) -> Any:
            try:
                return handle.generate.remote(
                    {"prompt": prompts[i % 8], **{k: gen[k] for k in gen if k != "model"}}
                ).result(timeout_s=TIMEOUT_S)
            except BackPressureError as e:
                return e

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(by_handle, range(16)))
        pushed_back = [o for o in outs if isinstance(o, BackPressureError)]
        assert pushed_back and all(o.status_code == 429 for o in pushed_back)
        for i, o in enumerate(outs):
            if not isinstance(o, BackPressureError):
                assert o["text"] == reference[i % 8]

        # Afterwards: served normally, nothing left admitted.
        wait_for(lambda: handle.ingress_stats.remote().result()["admitted"] == 0, 10, "places back")
        status, _, body = post(port, {**gen, "prompt": prompts[0]})
        assert status == 200 and body["choices"][0]["text"] == reference[0]
        assert call(port, "GET", "/health")[0] == 200
        # The deployment's context (max_model_len) reached its workers and the ingress.
        status, _, body = post(port, {**gen, "prompt": [5] * 64})
        assert status == 400 and "64 tokens" in body["error"]["message"], body
        status, _, body = post(port, {**gen, "prompt": [5] * 8, "max_tokens": 57})
        assert status == 400 and "context of 64 tokens" in body["error"]["message"], body
    finally:
        undeploy()
