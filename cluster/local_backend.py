"""``LocalBackend``: the ``Backend`` over one in-process ``Worker``, without Ray.

For serving from one process without Ray, and for tests of the HTTP layer.
The worker's step thread runs the engine; ``Worker.stream`` is a blocking iterator, so each
request gets a small pump thread that feeds its deltas into an ``asyncio.Queue``: the event
loop never blocks on the engine. A pump thread per request, not ``asyncio.to_thread``: the
default executor has few threads (cores + 4), and a long stream would hold one for its whole
life, capping concurrency far below the engine's batch size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest
from kvmesh.cluster.backend_tokens import TokenMethods
from kvmesh.cluster.metrics import tier_totals
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.outputs import StreamDelta
from kvmesh.workers.worker import Worker

logger = logging.getLogger(__name__)
_DONE = object()  # the pump's last item when the stream ended without an exception


class LocalBackend(TokenMethods):
    """One engine in this process. ``LocalBackend(EngineConfig(...))`` or, like ``LLM``,
    ``LocalBackend(model="tiny-random", block_size=4, num_kv_blocks=128)``.

    Contract (see ``Backend``): ``tokenize``/``tokenize_chat`` raise ValueError naming the
    field; ``stream`` raises the engine's ValueError (naming the field) from its first
    ``__anext__``, before anything is queued; closing or cancelling a stream aborts the
    request and frees its blocks.
    """

    def __init__(
        self, config: EngineConfig | None = None, *, name: str = "local-0", **engine_args: Any
    ) -> None:
        if config is None:
            config = EngineConfig(**engine_args)
        elif engine_args:
            raise ValueError(f"{next(iter(engine_args))}: give a config or engine args, not both")
        self.name = name
        self.worker = Worker(name, config)
        self.model_name = config.model
        self.max_model_len = self.worker.engine.max_model_len
        self.tokenizer = self.worker.engine.tokenizer
        self.vocab_size = self.worker.engine.model_config.vocab_size

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Completion:
        final: Completion | None = None
        async for chunk in self.stream(request):
            final = chunk.completion or final
        if final is None:
            raise RuntimeError(f"{self.name}: request {request.request_id} ended without output")
        return final

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        if request.messages is None and request.prompt is None:
            raise ValueError("prompt: give a prompt or messages")
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()
        threading.Thread(
            target=self._pump,
            args=(request, loop, items, stop),
            name=f"{self.name}-{request.request_id}",
            daemon=True,
        ).start()
        try:
            while True:
                item = await items.get()
                if item is _DONE:
                    raise RuntimeError(f"{self.name}: stream ended before a finish_reason")
                if isinstance(item, BaseException):
                    raise item
                yield self._chunk(request, item)
                if item.finish_reason is not None:
                    return
        finally:
            stop.set()  # a closed/cancelled stream: the pump aborts at the next delta

    def _pump(
        self,
        request: GenerateRequest,
        loop: asyncio.AbstractEventLoop,
        items: asyncio.Queue[Any],
        stop: threading.Event,
    ) -> None:
        """Runs in the request's thread: the chat template, then Worker.stream's deltas ->
        ``items`` (the template and the tokenizer are CPU work: never on the event loop)."""

        def post(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(items.put_nowait, item)

        try:
            prompt = self.prompt_ids(request)
            # closing() ends Worker.stream on break, whose finally aborts the request.
            with contextlib.closing(self.worker.stream(prompt, request.params)) as deltas:
                for delta in deltas:
                    post(delta)
                    if stop.is_set():
                        break
        except Exception as e:  # validation (ValueError) or an engine failure
            post(e)
        else:
            post(_DONE)

    def _chunk(self, request: GenerateRequest, delta: StreamDelta) -> Chunk:
        chunk = Chunk(
            request.request_id,
            delta.text,
            list(delta.token_ids),
            delta.finish_reason,
            logprobs=delta.logprobs,
            prompt_logprobs=delta.prompt_logprobs,
        )
        if delta.output is not None:
            chunk.completion = Completion.of(request.request_id, self.name, delta.output)
        return chunk

    # -- observability ------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        occupancy = await asyncio.to_thread(self.worker.occupancy)  # waits for the step thread
        conn = self.worker.kv.connector.get_stats()
        return {"workers": {self.name: occupancy}, **tier_totals([conn])}

    def shutdown(self) -> None:
        self.worker.shutdown()
