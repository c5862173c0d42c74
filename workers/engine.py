"""The single-worker engine: one model, one paged KV cache, continuous batching.

``step()`` reads like nano-vllm's: schedule, run, postprocess.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.workers.bad_words import with_bad_words_token_ids
from kvmesh.workers.block_hash import ModelFingerprint, cache_namespace
from kvmesh.workers.chat import prompt_token_ids
from kvmesh.workers.detokenizer import Detokenizer
from kvmesh.workers.engine_config import EngineConfig, usable_device
from kvmesh.workers.grammars import Grammars
from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.kv_cache_manager import KVCacheManager
from kvmesh.workers.kv_connector import KvCacheConnector, NoopKvCacheConnector, PullPlan
from kvmesh.workers.kv_tiers import KvTiers
from kvmesh.workers.loader import load_weights
from kvmesh.workers.logprobs import logprob_entries, prompt_logprob_entries
from kvmesh.workers.memory_room import allocate_kv_cache
from kvmesh.workers.model_runner import ModelRunner
from kvmesh.workers.model_setup import build_model
from kvmesh.workers.outputs import RequestOutput, StreamDelta
from kvmesh.workers.penalties import penalize
from kvmesh.workers.request import Request
from kvmesh.workers.request_checks import check_request
from kvmesh.workers.sampler import sample
from kvmesh.workers.sampling_params import SamplingParams
from kvmesh.workers.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from kvmesh.workers.tiered_connector import TieredKvConnector

logger = logging.getLogger(__name__)

KV_LAYOUT = "L2NBHD"  # KVCache.data: [layers, K/V, blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector factory gets: the worker it serves and that worker's KV cache."""

    worker_id: str
    kv_cache: KVCache
    fingerprint: ModelFingerprint


ConnectorFactory = Callable[[ConnectorContext], KvCacheConnector]
DeltaCallback = Callable[[StreamDelta], None]


@dataclass
class _Tracked:
    """Engine-side state of one request beyond its tokens."""

    request: Request
    params: SamplingParams
    seed: int  # the sampling randomness of output position i is a function of (seed, i)
    detokenizer: Detokenizer
    prompt: str | None
    on_delta: DeltaCallback | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as the prompt runs
    matcher: Any = None  # its grammar's llguidance matcher (structured outputs), else None


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KvCacheConnector | ConnectorFactory | None = None,
        worker_id: str = "local",
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self.device = usable_device(config.resolved_device)
        self.dtype = config.resolved_dtype
        weights = load_weights(config.model, progress=config.progress)
        self.model_config = mc = weights.config
        self.tokenizer = weights.tokenizer
        self.kv_dtype = config.resolved_kv_cache_dtype
        built = build_model(config, weights, self.device, self.dtype, self.kv_dtype)
        self.model = built.model
        self.num_quantized_weights = built.num_quantized_weights
        weights_id = weights.weights_id
        del weights  # the model holds its own copy of the tensors

        self.kv_cache, host_memory, self.max_model_len = allocate_kv_cache(
            config, mc, self.kv_dtype, self.device
        )
        self.fingerprint = ModelFingerprint(
            weights_id=weights_id,
            dtype=str(self.kv_dtype).removeprefix("torch."),
            compute_dtype=str(self.dtype).removeprefix("torch."),
            block_size=config.block_size,
            kv_layout=KV_LAYOUT,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            # What else changes the numbers, so the KV bytes of every layer after the first:
            # the attention implementation, the device, quantized matmuls and the C RMSNorm if
            # applied (model_setup.py).
            attention=built.attention,
            device=self.device.type,
            quantized_matmul=self.num_quantized_weights > 0,
            rmsnorm=built.rmsnorm,
        )
        if connector is not None and not isinstance(connector, KvCacheConnector):
            connector = connector(ConnectorContext(worker_id, self.kv_cache, self.fingerprint))
        tiers = config.tier_config
        if tiers.enabled:  # the local tiers sit in front of any other connector
            connector = TieredKvConnector(
                connector or NoopKvCacheConnector(),
                KvTiers(
                    tiers,
                    self.fingerprint.id,
                    self.kv_cache.block_bytes_all_layers,
                    host_memory=host_memory,
                ),
                self.kv_cache.read_block_into,
                self.kv_cache.write_block,
            )
        self.kv = KVCacheManager(
            self.kv_cache.num_blocks, config.block_size, connector, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv
        )
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        # Requests in the last step's batch; 0 while every request waits (e.g. for a load).
        self.last_batch_size = 0

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_delta: DeltaCallback | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
        pull_plan: PullPlan | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises ValueError."""
        return self.enqueue(
            self.make_request(
                prompt,
                params,
                request_id,
                on_delta,
                resumed_token_ids=resumed_token_ids,
                pull_plan=pull_plan,
            )
        )

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_delta: DeltaCallback | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
        pull_plan: PullPlan | None = None,
    ) -> _Tracked:
        """Validate a request without queuing it (so a batch is all or nothing).

        ``resumed_token_ids`` resumes a request cut off elsewhere: the output tokens that
        another worker already generated and streamed (text included). They are prefilled
        with the prompt, count toward ``max_tokens``, and are replayed through the
        detokenizer without a delta; sampling goes on at output position
        ``len(resumed_token_ids)``, so with the same seed (and the same params) the new tokens
        and deltas are exactly those the unbroken run would have streamed after them. The
        final ``RequestOutput`` has the original prompt as ``prompt_token_ids``, the resumed
        plus new tokens as ``token_ids``, the full text, and logprobs of the new tokens only
        (``num_resumed_tokens`` says where they start).

        ``pull_plan``: the cluster router's plan for the prefix (``PullPlan``), handed to the
        connector; without one the connector looks the prefix up itself.

        ``params.bad_words`` without their token ids (the Python API's: the API layers fill
        them where they tokenize the prompt) are tokenized here, as a text prompt is.
        """
        vocab = self.model_config.vocab_size
        params = with_bad_words_token_ids(params or SamplingParams(), self.tokenizer, vocab)
        token_ids = prompt_token_ids(self.tokenizer, prompt, vocab)
        text = prompt if isinstance(prompt, str) else None
        resumed = check_request(
            len(token_ids),
            params,
            resumed_token_ids,
            vocab_size=vocab,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
        )
        self.kv.check_fits(len(token_ids) + params.max_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._tracked:
            raise ValueError(f"request_id: {rid!r} is already running")
        detokenizer = Detokenizer(
            self.tokenizer,
            params.stop,
            params.min_tokens,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        # The client already has the resumed tokens' text: only the state that streaming
        # them left is needed, so the next delta holds back (or releases) what it would have.
        detokenizer.replay(resumed)
        if detokenizer.stopped_by is not None:
            raise ValueError(
                f"resumed_token_ids: their text holds the stop string "
                f"{detokenizer.stopped_by!r}, so the request has already finished"
            )
        if pull_plan is not None and not isinstance(pull_plan, PullPlan):
            raise ValueError("pull_plan: must be a PullPlan or None")
        req = Request(
            rid,
            token_ids,
            self.config.block_size,
            cache_namespace(self.fingerprint.namespace, params.cache_salt),
            params,
            resumed,
            pull_plan,
        )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        tracked = _Tracked(req, params, seed, detokenizer, text, on_delta)
        if params.structured_outputs is not None:
            tracked.matcher = self.grammars.matcher(params.structured_outputs, resumed)
        if params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None]  # the first token: nothing before it predicts it
        return tracked

    def enqueue(self, tracked: _Tracked) -> str:
        rid = tracked.request.request_id
        if rid in self._tracked:
            raise ValueError(f"request_id: {rid!r} is already running")
        self._tracked[rid] = tracked
        self.scheduler.add(tracked.request)
        return rid

    def abort(self, request_id: str, reason: str | None = None) -> None:
        """Drop a request and free its blocks; with ``reason``, its stream gets a last delta
        whose ``finish_reason`` is that reason (e.g. "error")."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.scheduler.finish(tracked.request)
        if reason is not None and tracked.on_delta is not None:
            tracked.on_delta(StreamDelta(request_id, finish_reason=reason))

    def request_ids(self) -> list[str]:
        return list(self._tracked)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def close(self) -> None:
        """Hand the pool's cached blocks to the connector (a disk tier keeps them for the next
        start), then close it (its threads; the disk tier finishes its writes). Only once no
        step runs."""
        blocks = self.kv.cached_blocks()
        self.kv.connector.on_stop([b.block_hash for b in blocks], [b.block_id for b in blocks])
        self.kv.connector.close()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Schedule, run, postprocess. Returns one delta per request that produced a token."""
        batch = self.scheduler.schedule()
        self.last_batch_size = len(batch)
        if not batch:
            return []
        logits = self.runner.run(batch, [self.kv.get_block_ids(s.request) for s in batch])
        sampling = [self._tracked[s.request.request_id] for s in batch if s.samples]
        params = [t.params for t in sampling]
        logits = self.grammars.mask_logits(
            logits, [(i, t.matcher) for i, t in enumerate(sampling) if t.matcher is not None]
        )
        chosen_from = penalize(
            logits,
            params,
            [t.request.prompt_token_ids for t in sampling],
            [t.request.output_token_ids for t in sampling],
            self.eos_token_ids,
        )
        tokens = sample(
            chosen_from,
            params,
            [t.seed for t in sampling],
            [len(t.request.output_token_ids) for t in sampling],
        )
        self._record_logprobs(logits, sampling, tokens)
        self._record_prompt_logprobs(batch)
        now = time.perf_counter()
        for s in batch:
            s.request.num_kv_tokens += s.num_new_tokens
            self.kv.cache_blocks(s.request, s.request.num_kv_tokens)
        return [self._postprocess(t, tok, now) for t, tok in zip(sampling, tokens, strict=True)]

    @staticmethod
    def _record_logprobs(logits: torch.Tensor, sampling: list[_Tracked], tokens: list[int]) -> None:
        rows = [i for i, t in enumerate(sampling) if t.params.logprobs is not None]
        for i in rows:  # one row at a time: each asks for its own top N
            t = sampling[i]
            (entry,) = logprob_entries(
                logits[i : i + 1].log_softmax(-1), [tokens[i]], t.params.logprobs
            )
            if t.logprobs is None:
                t.logprobs = []
            t.logprobs.append(entry)

    def _record_prompt_logprobs(self, batch: list[ScheduledRequest]) -> None:
        """The prompt tokens' entries from the positions this step computed (a preempted
        request computes them again: only positions not yet recorded are kept)."""
        for i, first, hidden in self.runner.prompt_hidden:
            req = batch[i].request
            t = self._tracked[req.request_id]
            assert t.prompt_logprobs is not None  # set by make_request
            skip = len(t.prompt_logprobs) - (first + 1)  # already recorded
            if skip < hidden.shape[0]:
                t.prompt_logprobs += prompt_logprob_entries(
                    self.model.compute_logits,
                    hidden[max(0, skip) :],
                    first + max(0, skip),
                    req.prompt_token_ids,
                    t.params.prompt_logprobs,
                )

    def _postprocess(self, t: _Tracked, token: int, now: float) -> StreamDelta:
        req, params = t.request, t.params
        req.append_output_token(token)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        # A grammar ends the request when it refuses the token (other masks left it none:
        # the token is not text), or takes EOS under ignore_eos (its end allows only EOS).
        refused = t.matcher is not None and not t.matcher.consume_token(token)
        eos = token in self.eos_token_ids
        if token in params.stop_token_ids or (eos and not params.ignore_eos):
            t.finish_reason, t.stop_reason = "stop", token
        elif refused or (eos and t.matcher is not None and t.matcher.is_stopped()):
            t.finish_reason, t.stop_reason = "stop", None if refused else token
        elif len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            t.finish_reason = "length"
        shown = req.output_token_ids
        if refused or (t.finish_reason == "stop" and not params.include_stop_str_in_output):
            shown = shown[:-1]  # the EOS or stop token that ended it is not text (vLLM's)
        text = t.detokenizer.update(shown, final=t.finish_reason is not None)
        if t.detokenizer.stopped_by is not None and t.finish_reason != "stop":
            t.finish_reason, t.stop_reason = "stop", t.detokenizer.stopped_by
            text += t.detokenizer.update(shown, final=True)
        delta = StreamDelta(req.request_id, [token], text, t.finish_reason)
        if t.logprobs is not None:  # recorded for this token just before
            delta.logprobs = t.logprobs[-1:]
        if len(req.output_token_ids) == req.num_resumed_tokens + 1:  # the first one here
            delta.prompt_logprobs = t.prompt_logprobs
        if t.finish_reason is not None:
            req.metrics.finished_time = now
            self.scheduler.finish(req)
            del self._tracked[req.request_id]
            delta.output = self._output(t)
        if t.on_delta is not None:
            t.on_delta(delta)
        return delta

    def _output(self, t: _Tracked) -> RequestOutput:
        req = t.request
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),  # resumed tokens first
            text=t.detokenizer.text,  # the resumed tokens' text included
            finish_reason=t.finish_reason,
            metrics=req.metrics,
            stop_reason=t.stop_reason,
            prompt=t.prompt,
            logprobs=t.logprobs,  # the tokens generated here, after the resumed ones
            num_resumed_tokens=req.num_resumed_tokens,
            prompt_logprobs=t.prompt_logprobs,
        )
