"""Overload: queues are bounded end to end, and the excess is refused at once.

Admission as a unit (the bound, OpenAI's 429 body, Retry-After, the schema), Serve's
``BackPressureError`` from a worker deployment mapped to a 429 too, and the Serve app on real
Ray under a burst far above its limit: every answer is a 200 or a 429 with Retry-After, every
admitted request gives the unloaded answer, nothing hangs, and afterwards it serves normally.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import logging
import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from kvmesh.cluster.admission import Admission
from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.http_errors import Overloaded
from kvmesh.cluster.launch import add_serve_args, config_from_args
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from kvmesh.cluster.replica_logs import ClientErrorsAtInfo
from kvmesh.cluster.serve_app import KvmeshServer
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


# -- the bound, without Ray -------------------------------------------------------------------


def test_admission_admits_up_to_its_limit_and_refuses_the_rest_at_once() -> None:
    admission = Admission(3, retry_after_s=2.5)
    for _ in range(3):
        admission.enter()
    with pytest.raises(Overloaded) as refused:
        admission.enter()
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "3"}
    assert (admission.admitted, admission.refused) == (3, 1)
    admission.leave()
    admission.enter()  # a place given back is a place again
    for _ in range(3):
        admission.leave()
    with pytest.raises(RuntimeError):
        admission.leave()
    unbounded = Admission(None)
    for _ in range(10_000):
        unbounded.enter()
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="limit"):
            Admission(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retry_after_s"):
        Admission(1, retry_after_s=float("nan"))


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


def test_a_request_holds_a_place_per_choice() -> None:
    admission = Admission(4)
    admission.enter()
    admission.grow(1, 2)  # a request of 3 choices
    assert admission.admitted == 3
    admission.enter()  # the last place
    with pytest.raises(Overloaded, match="need 1 more places than the 0 free"):
        admission.grow(1, 1)  # 2 choices: refused, and it keeps the one it held
    assert (admission.admitted, admission.refused) == (4, 1)
    admission.leave(3), admission.leave()
    # More choices than the limit: only alone, so that it can run at all.
    admission.enter()
    admission.grow(1, 9)
    assert admission.admitted == 10
    with pytest.raises(Overloaded):
        admission.enter()
    admission.leave(10)
    with pytest.raises(RuntimeError):
        admission.leave()


def test_admit_holds_every_choice_or_none() -> None:
    admission = Admission(3)
    with admission.admit(2) as admitted:
        assert (admitted.places, admission.admitted) == (2, 2)
        with pytest.raises(Overloaded):
            admission.admit(2)  # one free place: refused, and it keeps none
        assert admission.admitted == 2
    assert admission.admitted == 0


def test_a_handle_call_past_the_limit_is_refused_before_its_body_is_parsed() -> None:
    """As over HTTP: a full ingress refuses a handle call (Serve's ``BackPressureError``)
    without validating or tokenizing it, and a refused or rejected call holds no place."""
    # The class under Serve's ingress wrapper (whose async __del__ a bare instance would
    # leave unawaited), without its constructor: the methods under test use only admission.
    server = object.__new__(KvmeshServer.__bases__[0])
    server.admission = Admission(1, retry_after_s=2.5)
    garbage = {"messages": 5}
    server.admission.enter()  # the one place is taken
    for method in (server.chat, server.completions):
        with pytest.raises(BackPressureError) as refused:
            asyncio.run(method(garbage))
        assert refused.value.status_code == 429 and refused.value.retry_after_s == 3
    server.admission.leave()
    with pytest.raises(ApiError) as bad:
        asyncio.run(server.chat(garbage))
    assert bad.value.status == 400 and server.admission.admitted == 0


def test_a_refused_handle_call_is_one_info_line_not_an_error_with_a_traceback() -> None:
    """Serve logs whatever a replica's method raises as an ERROR with its traceback; a
    client's error (a 4xx ``ApiError``, ``BackPressureError``) becomes one INFO line."""
    logger = logging.getLogger("kvmesh.test.serve_like")
    logger.propagate = False
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.addFilter(ClientErrorsAtInfo())
    raised = [
        ApiError(400, "n: must be at least 1", param="n"),
        BackPressureError(4, 4, status_code=429),
        ApiError(500, "internal server error (ref x)", "server_error"),
        RuntimeError("a bug"),
    ]
    for e in raised:
        try:
            raise e
        except Exception:
            logger.exception("Request failed.")
    levels = [r.levelname for r in records]
    assert levels == ["INFO", "INFO", "ERROR", "ERROR"]
    assert records[0].getMessage() == "Request failed. Refused with 400: n: must be at least 1"
    assert "Refused with 429: Request dropped due to backpressure" in records[1].getMessage()
    assert [r.exc_info is None for r in records] == [True, True, False, False]


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
        assert stats["limit"] == 4 and stats["refused"] == len(refused)

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


def test_threads_share_one_admission_exactly() -> None:
    """Serve may run the handle's methods and the ASGI app on different threads."""
    admission = Admission(50)
    got = []

    def grab() -> None:
        for _ in range(200):
            try:
                admission.enter()
                got.append(1)
            except Overloaded:
                pass

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 50 and admission.admitted == 50 and admission.refused == 8 * 200 - 50
