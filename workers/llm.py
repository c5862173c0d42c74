"""`LLM`: the offline Python API that vLLM users know."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvmesh.workers.chat import chat_prompt_ids
from kvmesh.workers.engine import ConnectorFactory, LLMEngine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.kv_connector import KvCacheConnector
from kvmesh.workers.outputs import RequestOutput, StreamDelta
from kvmesh.workers.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """A model with a paged KV cache and prefix caching, on one device.

    >>> llm = LLM("tiny-random", num_kv_blocks=64)
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0]
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        block_size: int = 16,
        kv_cache_memory: str | int = "1GiB",
        device: str | None = None,
        dtype: str | None = None,
        connector: KvCacheConnector | ConnectorFactory | None = None,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig(
            model=model,
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            device=device,
            dtype=dtype,
            **engine_args,
        )
        self.engine = LLMEngine(config, connector)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``."""
        ids = self._submit(prompts, params)
        outputs = {d.request_id: d.output for d in self._drain(ids) if d.output is not None}
        return [outputs[rid] for rid in ids]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield each request's new tokens and text as the engine produces them; the last
        delta of a request carries its whole ``RequestOutput``."""
        return self._drain(self._submit(prompts, params))

    def _submit(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[str]:
        """Validate every prompt, then queue them all: a bad one queues nothing."""
        batch = _as_batch(prompts)
        plist = _as_params(params, len(batch))
        tracked = [self.engine.make_request(p, sp) for p, sp in zip(batch, plist, strict=True)]
        return [self.engine.enqueue(t) for t in tracked]

    def _drain(self, ids: list[str]) -> Iterator[StreamDelta]:
        pending = set(ids)
        try:
            while pending:
                for delta in self.engine.step():
                    if delta.request_id in pending:
                        if delta.finish_reason is not None:
                            pending.discard(delta.request_id)
                        yield delta
                if not self.engine.last_batch_size:  # every request waits for a load
                    time.sleep(0.0005)
        finally:
            for rid in pending:  # the caller stopped early: free what is left
                self.engine.abort(rid)

    def close(self) -> None:
        """Stop the engine's connector threads (the disk tier finishes its writes first)."""
        self.engine.close()

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the reply (or,
        with ``continue_final_message`` and ``add_generation_prompt=False``, the rest of the
        last message: vLLM's ``LLM.chat`` options)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        template = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        prompts = [self.chat_prompt(c, **template) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def chat_prompt(self, messages: Sequence[Message], **template: bool) -> list[int]:
        """The token ids the chat template gives for ``messages`` plus the assistant turn
        (``template``: ``chat_prompt_ids``'s options)."""
        return chat_prompt_ids(self.tokenizer, messages, **template)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts: must be a string, token ids, or a list of them, got {type(prompts).__name__}"
        )
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _as_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Sequence) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(
            f"params: must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    if len(params) != n:
        raise ValueError(f"params: {len(params)} given for {n} prompts")
    return list(params)
