"""Stopping the app: requests still running when Serve deletes it end with a clear 503.

Real Ray Serve and the tiny-random model. Serve drains each replica before it kills it, but
tells the ingress nothing: before this, a request still running when the ingress was killed
got Serve's proxy's bare text/plain 500 (or a cut stream) after ~20 s. Now the ingress sees
its app deleting, refuses new requests and, ``drain_timeout_s`` later, ends what still runs
with OpenAI's error body: a 503 for an answer sent whole, an error event in a stream.
"""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest
from ray import serve

from kvmesh.cluster.front_door import APP_GONE
from kvmesh.cluster.frontend import SHUTTING_DOWN
from kvmesh.cluster.serve_app import APP_NAME
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import busy_worker, redeploy, tiny_config, undeploy, wait_for

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]
LONG = {"prompt": list(range(7, 90)), "max_tokens": 1900, "extra_body": {"ignore_eos": True}}


def test_requests_running_when_the_app_is_deleted_end_with_a_503() -> None:
    config = tiny_config(workers=1, drain_timeout_s=1.0, stream_interval_s=0.0)
    app = redeploy(config)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.port}/v1", api_key="none", max_retries=0, timeout=60
    )
    try:
        stream = client.completions.create(model=config.model_name, stream=True, **LONG)
        first = next(iter(stream))
        assert first.choices[0].text is not None
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            whole = pool.submit(client.completions.create, model=config.model_name, **LONG)
            wait_for(lambda: busy_worker(app), 10, "the requests to run")
            deleted = time.monotonic()
            pool.submit(serve.delete, APP_NAME)
            with pytest.raises(openai.APIError) as streamed:
                for _ in stream:
                    pass
            with pytest.raises(openai.InternalServerError) as answered:
                whole.result()
            ended_s = time.monotonic() - deleted
        assert SHUTTING_DOWN in streamed.value.message, streamed.value
        assert answered.value.status_code == 503
        body = answered.value.body
        assert body["message"] == SHUTTING_DOWN and body["code"] == "unavailable", body
        # The drain (1 s) and the ingress's look at the app's status (every 1 s), well before
        # Serve would kill the ingress (drain + 5 s).
        assert ended_s < 4.0, ended_s
        wait_for(lambda: APP_NAME not in serve.status().applications, 30, "the app to go")
        # A request after it: the front door turns Serve's plain 404 into a 503 to retry.
        with pytest.raises(openai.InternalServerError) as gone:
            client.completions.create(model=config.model_name, prompt="hi", max_tokens=2)
        assert gone.value.status_code == 503 and gone.value.body["message"] == APP_GONE
        assert int(gone.value.response.headers["retry-after"]) >= 1
    finally:
        undeploy()
