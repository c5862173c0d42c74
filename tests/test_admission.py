"""Admission as a unit, without Ray: the bound on the sequences an ingress replica holds,
a place per choice, all or none, shared by threads; and the Python handle's side of it
(refused before its body is parsed, logged as one INFO line). The Serve app under a burst
and the HTTP 429s are tests/test_overload.py's."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from ray.serve.exceptions import BackPressureError

from kvmesh.cluster.admission import Admission
from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.http_errors import Overloaded
from kvmesh.cluster.replica_logs import ClientErrorsAtInfo
from kvmesh.cluster.serve_app import KvmeshServer


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
