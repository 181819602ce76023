"""``TensorRTLLMBackend``: the engine interface over TensorRT-LLM's LLM API.

Written against the documented LLM API of TensorRT-LLM 1.x (PyTorch backend;
https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html):
``LLM(**llm_args)`` (:mod:`.llm_args`), then per request
``llm.generate_async(prompt_token_ids, sampling_params, streaming=True)``
(:mod:`.sampling_map`), whose result is an async iterator of ``RequestOutput``
read by :mod:`.outputs`; ``result.abort()`` cancels it. While the engine runs,
two tasks read ``llm.get_stats_async()`` (:mod:`.stats`: ``load()`` and the
step metrics) and ``llm.get_kv_cache_events_async()`` (:mod:`.kv_events`: the
same KV event stream as the torch engine, drained by the publisher).

``tensorrt_llm`` is imported in :meth:`TensorRTLLMBackend.start` only, so this
module imports on machines without it (:mod:`.availability`).

Reads these :class:`EngineConfig` fields: those of :mod:`.llm_args` and
:mod:`.speculative_map`, plus ``served_model_name`` and ``max_model_len``.

Status codes (besides :mod:`services.engine.validation`'s): a sampling field
TensorRT-LLM cannot honour, or per-request speculation other than the
engine's: INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from services.common.block_hash import block_hash_seed
from services.common.checkpoint import check_checkpoint_dir
from services.common.kv_events import KVEvent, KVSnapshot
from services.common.sampling import FinishReason, SamplingOptions
from services.common.tasks import cancel_and_wait
from services.engine.backend import (
    DeltaSink,
    DuplicateRequestError,
    EngineBackend,
    EngineUnavailableError,
    PumpedSubmission,
    Submission,
)
from services.engine.config import EngineConfig
from services.engine.tensorrt_llm_backend.availability import INSTALL_HINT, tensorrt_llm_installed
from services.engine.tensorrt_llm_backend.kv_events import KvEventConverter
from services.engine.tensorrt_llm_backend.llm_args import KV_EVENT_BUFFER, llm_spec
from services.engine.tensorrt_llm_backend.outputs import finish_reason, position_logprobs
from services.engine.tensorrt_llm_backend.request_map import generate_args
from services.engine.tensorrt_llm_backend.sampling_map import IMPLEMENTED_FEATURES, SamplingSpec
from services.engine.tensorrt_llm_backend.speculative_map import speculative_spec
from services.engine.tensorrt_llm_backend.stats import capped_load, parse_iteration_stats
from services.engine.types import LoadStats, ModelInfo, SequenceRequest, StepStats, TokenDelta

log = structlog.get_logger()

__all__ = ["IMPLEMENTED_FEATURES", "INSTALL_HINT", "TensorRTLLMBackend"]

#: Seconds each ``get_*_async`` read waits for entries before it is made again.
POLL_TIMEOUT_S = 0.5
#: Seconds between two reads (in case a read returns at once when empty).
READ_PAUSE_S = 0.01
#: Most seconds ``start`` waits for the first iteration stats (the KV capacity).
FIRST_STATS_TIMEOUT_S = 5.0


class TensorRTLLMBackend(EngineBackend):
    """TensorRT-LLM's in-flight batching engine behind :class:`EngineBackend`.

    In-flight batching, the paged KV cache with block reuse, speculative
    decoding and scheduling are TensorRT-LLM's. ``load()`` comes from the
    iteration stats (see :meth:`load`). ``cancel_choice`` is not supported
    (TensorRT-LLM aborts whole requests): False.

    Args:
      config: engine options.
      step_observer: called on the event loop with each iteration's stats.

    Raises:
      ValueError: speculative options TensorRT-LLM cannot start with
        (:func:`.speculative_map.speculative_spec`), before anything loads.
    """

    name = "tensorrt_llm"

    def __init__(self, config: EngineConfig,
                 step_observer: Callable[[StepStats], None] | None = None) -> None:
        speculative_spec(config)
        self._config = config
        self._step_observer = step_observer
        self._start_lock = asyncio.Lock()
        self._llm: Any = None
        self._classes: dict[str, Any] = {}
        self._info: ModelInfo | None = None
        self._results: dict[str, Any] = {}
        self._started: set[str] = set()
        self._load: LoadStats | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._events_lock = threading.Lock()
        self._events: collections.deque[KVEvent] = collections.deque()
        self._events_dropped = 0
        self._converter: KvEventConverter | None = None
        self._first_stats = asyncio.Event()

    def check_available(self) -> None:
        """Raises EngineUnavailableError (the install command) when
        TensorRT-LLM is not installed here; imports nothing."""
        if not tensorrt_llm_installed():
            raise EngineUnavailableError(INSTALL_HINT)

    def check_model_files(self) -> None:
        """Refuses, before anything loads, a missing ``--model-path``, a GGUF
        file, or a path that is not a directory with a ``config.json`` that
        parses (a Hugging Face checkpoint or TensorRT-LLM engine directory)."""
        self._model_path()

    async def start(self) -> None:
        """Imports tensorrt_llm, builds/loads the engine (blocking work runs in a
        thread), starts reading stats and KV events, warms it up with one short
        request and waits (up to :data:`FIRST_STATS_TIMEOUT_S`) for the first
        iteration stats, which give ``model_info`` its KV capacity. Idempotent.

        Raises:
          EngineUnavailableError: tensorrt_llm is not installed (or does not import).
          ValueError: no model path, a GGUF path (TensorRT-LLM reads HF
            checkpoints), or bad speculative options.
        """
        async with self._start_lock:
            if self._llm is not None:
                return
            try:
                import tensorrt_llm
                from tensorrt_llm import llmapi
            except ImportError as exc:
                raise EngineUnavailableError(f"{INSTALL_HINT} ({exc})") from exc
            path = self._model_path()
            info = await asyncio.to_thread(_read_model_info, path, self._config)
            spec = llm_spec(self._config, path, info.max_model_len)
            kwargs = dict(spec.kwargs, kv_cache_config=llmapi.KvCacheConfig(**spec.kv_cache_config))
            if spec.cuda_graph_config is not None:
                kwargs["cuda_graph_config"] = llmapi.CudaGraphConfig(**spec.cuda_graph_config)
            if spec.speculative is not None:
                decoding = getattr(llmapi, spec.speculative.class_name)
                kwargs["speculative_config"] = decoding(**spec.speculative.kwargs)
            self._llm = await asyncio.to_thread(tensorrt_llm.LLM, **kwargs)
            self._classes = {"SamplingParams": tensorrt_llm.SamplingParams,
                             "GuidedDecodingParams": llmapi.GuidedDecodingParams}
            self._info = info
            if self._config.enable_prefix_caching:
                self._converter = KvEventConverter(info.kv_hash_seed, info.kv_block_size)
                self._tasks.append(asyncio.create_task(self._read_kv_events(),
                                                       name="trtllm-kv-events"))
            self._tasks.append(asyncio.create_task(self._read_stats(), name="trtllm-stats"))
            await self._warm_up()
            with contextlib.suppress(TimeoutError):  # model_info's KV capacity comes with it
                async with asyncio.timeout(FIRST_STATS_TIMEOUT_S):
                    await self._first_stats.wait()

    def _model_path(self) -> Path:
        path = self._config.model_path
        if path is None:
            raise ValueError("the tensorrt_llm backend needs --model-path "
                             "(a Hugging Face checkpoint directory or engine directory)")
        if path.suffix == ".gguf":
            raise ValueError(f"{path} is a GGUF file; TensorRT-LLM reads Hugging Face "
                             "checkpoints: pass their directory as --model-path")
        check_checkpoint_dir(path, weights=False)  # or an engine directory: no safetensors
        return path

    async def _warm_up(self) -> None:
        request = SequenceRequest("warm-up", (self.model_info.eos_token_ids[0],) * 4,
                                  SamplingOptions(max_tokens=2, ignore_eos=True))
        async for _ in self.generate(request):
            pass

    @property
    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailableError("the tensorrt_llm engine is not started")
        return self._info

    def submit(self, request: SequenceRequest, sink: DeltaSink) -> Submission:
        """See :meth:`EngineBackend.submit`: TensorRT-LLM streams each request
        on its own (``generate_async``), so one task per request reads
        :meth:`generate` into ``sink`` (:class:`PumpedSubmission`); its
        refusals go to ``sink.fail``."""
        return PumpedSubmission(self.generate(request), sink)

    async def generate(self, request: SequenceRequest) -> AsyncIterator[TokenDelta]:
        """See :meth:`EngineBackend.generate`; one ``generate_async`` stream per
        request, read as it comes (one delta per choice and chunk: the
        library's iterator is the request's one buffer, so no sink here).

        Raises (besides the interface's): InvalidRequestError INVALID_ARGUMENT
        for what TensorRT-LLM cannot honour (:func:`.request_map.generate_args`:
        every request field is classified there and in :mod:`.sampling_map`).
        """
        args = generate_args(request, self.model_info, self._config)
        spec = args.sampling
        if self._llm is None:
            raise EngineUnavailableError("the tensorrt_llm engine is not running")
        if request.request_id in self._results:
            raise DuplicateRequestError(f"request {request.request_id!r} is already running")
        scoped = {} if args.cache_salt is None else {"cache_salt": args.cache_salt}
        result = self._llm.generate_async(
            args.prompt_token_ids, sampling_params=self._sampling_params(spec), streaming=True,
            **scoped)
        self._results[request.request_id] = result
        open_choices = set(range(request.sampling.n))
        sent = [0] * request.sampling.n  # tokens yielded per choice
        try:
            async for output in result:
                self._started.add(request.request_id)
                for completion in output.outputs:
                    if completion.index not in open_choices:
                        continue
                    delta = self._delta(request, completion, spec, sent[completion.index])
                    if delta is None:
                        continue
                    sent[delta.index] = delta.num_generated_tokens
                    if delta.finished:
                        open_choices.discard(delta.index)
                    yield delta
                if not open_choices:
                    return
            for index in sorted(open_choices):  # the stream ended without a reason
                open_choices.discard(index)
                yield self._final(request, result, index)
        finally:
            self._results.pop(request.request_id, None)
            self._started.discard(request.request_id)
            if open_choices:
                result.abort()

    def _sampling_params(self, spec: SamplingSpec) -> Any:
        params = dict(spec.params)
        if spec.guided_decoding is not None:
            params["guided_decoding"] = self._classes["GuidedDecodingParams"](
                **spec.guided_decoding)
        return self._classes["SamplingParams"](**params)

    def _delta(self, request: SequenceRequest, completion: Any, spec: SamplingSpec,
               sent: int) -> TokenDelta | None:
        """The delta of one choice after its first ``sent`` tokens; None when
        there is nothing new. Not ``token_ids_diff``: a response updates one
        choice, and the others keep their previous diff."""
        token_ids = tuple(completion.token_ids[sent:])
        reason = finish_reason(completion.finish_reason)
        if not token_ids and reason is FinishReason.NONE:
            return None
        logprobs = () if spec.keep_logprobs is None else position_logprobs(
            token_ids, completion.logprobs[sent:sent + len(token_ids)], spec.keep_logprobs)
        return TokenDelta(
            request_id=request.request_id, token_ids=token_ids, finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=len(completion.token_ids), logprobs=logprobs,
            index=completion.index)

    def _final(self, request: SequenceRequest, result: Any, index: int) -> TokenDelta:
        """The last delta of a choice the stream ended without a reason for
        (TensorRT-LLM names one only once the whole request is final, so with
        n > 1 a choice that ended earlier has none): the torch engine's rule on
        its tokens, a stop id first, then ``max_tokens``."""
        outputs = result.outputs or []
        token_ids = list(outputs[index].token_ids) if index < len(outputs) else []
        options = request.sampling
        stops = {*options.stop_token_ids, *(() if options.ignore_eos
                                            else self.model_info.eos_token_ids)}
        ended_on_stop = bool(token_ids) and token_ids[-1] in stops
        reason = (FinishReason.LENGTH if len(token_ids) >= options.max_tokens and not ended_on_stop
                  else FinishReason.STOP)
        return TokenDelta(request_id=request.request_id, token_ids=(), finish_reason=reason,
                          num_prompt_tokens=len(request.prompt_token_ids),
                          num_generated_tokens=len(token_ids), index=index)

    def cancel(self, request_id: str) -> bool:
        result = self._results.get(request_id)
        if result is None:
            return False
        result.abort()
        return True

    def load(self) -> LoadStats:
        """See :func:`.stats.capped_load`: the iteration stats, capped by the
        requests in flight here."""
        return capped_load(self._load, len(self._results), len(self._started))

    def drain_kv_events(self) -> list[KVEvent]:
        with self._events_lock:
            events = list(self._events)
            self._events.clear()
        return events

    def kv_events_dropped(self) -> int:
        with self._events_lock:
            return self._events_dropped

    def kv_snapshot(self) -> KVSnapshot | None:
        """Our hashes of the blocks TensorRT-LLM's events said it holds, taken
        with dropping the undrained events (they are in the snapshot)."""
        if self._converter is None:
            return None
        with self._events_lock:
            self._events.clear()
            return KVSnapshot(self._converter.block_hashes(), self._events_dropped)

    async def shutdown(self) -> None:
        """Aborts in-flight requests, stops the readers and shuts TensorRT-LLM
        down. Idempotent."""
        for result in list(self._results.values()):
            result.abort()
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks.clear()
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    # ---- readers (event loop tasks) --------------------------------------------------

    async def _read_stats(self) -> None:
        """Feeds ``load()``, the KV capacity in ``model_info`` and the step observer."""
        try:
            while self._llm is not None:
                async for entry in self._llm.get_stats_async(timeout=POLL_TIMEOUT_S):
                    self._apply_stats(entry)
                await asyncio.sleep(READ_PAUSE_S)
        except Exception as exc:  # a reader must not die silently: load() would freeze
            log.error("trtllm_stats_reader_failed", error=repr(exc))
            raise

    def _apply_stats(self, entry: Any) -> None:
        snapshot = parse_iteration_stats(entry)
        self._load = snapshot.load
        info = self._info
        if info is not None and snapshot.kv_capacity_blocks and not info.kv_capacity_tokens:
            per_block = snapshot.tokens_per_block or self._config.block_size
            self._info = replace(info, kv_capacity_tokens=snapshot.kv_capacity_blocks * per_block)
        self._first_stats.set()
        if self._step_observer is not None:
            self._step_observer(snapshot.step)

    async def _read_kv_events(self) -> None:
        """Converts KV events into the bounded buffer ``drain_kv_events`` empties."""
        converter = self._converter
        assert converter is not None
        try:
            while self._llm is not None:
                async for event in self._llm.get_kv_cache_events_async(timeout=POLL_TIMEOUT_S):
                    with self._events_lock:
                        self._buffer(converter, event)
                await asyncio.sleep(READ_PAUSE_S)
        except Exception as exc:
            log.error("trtllm_kv_event_reader_failed", error=repr(exc))
            raise

    def _buffer(self, converter: KvEventConverter, event: Any) -> None:
        """Converts one event into the buffer (the caller holds the events lock)."""
        try:
            converted = converter.convert(event)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("trtllm_kv_event_unreadable", error=repr(exc))
            return
        for item in converted:
            if len(self._events) >= KV_EVENT_BUFFER:
                self._events_dropped += 1
            else:
                self._events.append(item)


def _read_model_info(path: Path, config: EngineConfig) -> ModelInfo:
    """Vocabulary, EOS ids and context window from the HF checkpoint's config
    files; the block hash seed covers the model id and this backend's KV layout
    (``tensorrt_llm/<dtype>``)."""
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(str(path))
    eos: Any = getattr(hf_config, "eos_token_id", None)
    with contextlib.suppress(OSError):
        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id or eos
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    if not eos_ids or eos_ids[0] is None:
        raise ValueError(f"{path} names no eos_token_id")
    context = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    max_model_len = config.max_model_len or context
    if not max_model_len:
        raise ValueError(f"{path} names no max_position_embeddings: pass --max-model-len")
    model = config.model_name(path)
    caching = config.enable_prefix_caching
    return ModelInfo(model=model, max_model_len=max_model_len,
                     vocab_size=int(hf_config.vocab_size), eos_token_ids=eos_ids,
                     backend=TensorRTLLMBackend.name, max_num_seqs=config.max_num_seqs,
                     kv_block_size=config.block_size if caching else 0,
                     kv_hash_seed=block_hash_seed(model, f"tensorrt_llm/{config.dtype}")
                     if caching else b"")
