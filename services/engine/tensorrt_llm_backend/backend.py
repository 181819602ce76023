"""``TensorRTLLMBackend``: the engine interface over TensorRT-LLM's LLM API.

Written against the documented LLM API (``tensorrt_llm.LLM``,
``tensorrt_llm.SamplingParams``, ``tensorrt_llm.llmapi.KvCacheConfig``):
``LLM(model, skip_tokenizer_init=True, kv_cache_config=KvCacheConfig(
enable_block_reuse=True, ...))`` and, per request,
``llm.generate_async(prompt_token_ids, sampling_params, streaming=True)``, whose
result is an async iterator of ``RequestOutput`` with ``outputs[0].token_ids_diff``
and ``finish_reason``; ``result.abort()`` cancels it.

``tensorrt_llm`` is imported in :meth:`TensorRTLLMBackend.start` only, so this
module imports on machines without it; selecting the backend there raises
:class:`EngineUnavailableError` with the install hint.

Reads these :class:`EngineConfig` fields: ``model_path`` (a Hugging Face
checkpoint directory or hub id, or a built engine directory — not a GGUF),
``served_model_name``, ``max_model_len``, ``max_num_seqs``,
``gpu_memory_fraction``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.common.sampling import FinishReason, SamplingOptions
from services.engine.backend import DuplicateRequestError, EngineBackend, EngineUnavailableError
from services.engine.config import EngineConfig
from services.engine.types import LoadStats, ModelInfo, SequenceRequest, TokenDelta
from services.engine.validation import refuse_unimplemented, validate_request

INSTALL_HINT = ("the tensorrt_llm backend needs TensorRT-LLM on a CUDA host: "
                "pip install 'llmesh[tensorrt-llm]' --extra-index-url https://pypi.nvidia.com")

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,
    "timeout": FinishReason.CANCELLED,
}


#: The optional sampling features (:data:`~services.engine.validation.OPTIONAL_FEATURES`)
#: this backend implements; a request using another is UNIMPLEMENTED.
IMPLEMENTED_FEATURES: frozenset[str] = frozenset()


class TensorRTLLMBackend(EngineBackend):
    """TensorRT-LLM's in-flight batching engine behind :class:`EngineBackend`.

    In-flight batching, the paged KV cache with block reuse, and scheduling are
    TensorRT-LLM's. ``load()`` counts this backend's own requests: a request is
    "waiting" until its first output arrives, then "running"; KV usage is not
    reported yet (0.0).
    """

    name = "tensorrt_llm"

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._start_lock = asyncio.Lock()
        self._llm: Any = None
        self._sampling_params_cls: Any = None
        self._info: ModelInfo | None = None
        self._results: dict[str, Any] = {}
        self._started: set[str] = set()

    async def start(self) -> None:
        """Imports tensorrt_llm, builds/loads the engine (blocking work runs in a
        thread) and warms it up with one short request. Idempotent.

        Raises:
          EngineUnavailableError: tensorrt_llm is not installed.
          ValueError: no model path, or a GGUF path (TensorRT-LLM reads HF checkpoints).
        """
        async with self._start_lock:
            if self._llm is not None:
                return
            try:
                from tensorrt_llm import LLM, SamplingParams
                from tensorrt_llm.llmapi import KvCacheConfig
            except ImportError as exc:
                raise EngineUnavailableError(INSTALL_HINT) from exc
            path = self._model_path()
            info = await asyncio.to_thread(_read_model_info, path, self._config)
            kv_cache_config = KvCacheConfig(
                enable_block_reuse=True,
                free_gpu_memory_fraction=self._config.gpu_memory_fraction)
            self._llm = await asyncio.to_thread(
                LLM, model=str(path), skip_tokenizer_init=True, kv_cache_config=kv_cache_config,
                max_seq_len=info.max_model_len, max_batch_size=self._config.max_num_seqs)
            self._sampling_params_cls = SamplingParams
            self._info = info
            await self._warm_up()

    def _model_path(self) -> Path:
        path = self._config.model_path
        if path is None:
            raise ValueError("the tensorrt_llm backend needs --model-path "
                             "(a Hugging Face checkpoint directory or engine directory)")
        if path.suffix == ".gguf":
            raise ValueError(f"{path} is a GGUF file; TensorRT-LLM reads Hugging Face "
                             "checkpoints: pass their directory as --model-path")
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

    async def generate(self, request: SequenceRequest) -> AsyncIterator[TokenDelta]:
        """See :meth:`EngineBackend.generate`; one ``generate_async`` stream per request."""
        validate_request(request, self.model_info)
        refuse_unimplemented(request.sampling, IMPLEMENTED_FEATURES, "tensorrt_llm")
        if self._llm is None:
            raise EngineUnavailableError("the tensorrt_llm engine is not running")
        if request.request_id in self._results:
            raise DuplicateRequestError(f"request {request.request_id!r} is already running")
        result = self._llm.generate_async(
            list(request.prompt_token_ids), sampling_params=self._sampling_params(request),
            streaming=True)
        self._results[request.request_id] = result
        finished = False
        try:
            async for output in result:
                delta = self._delta(request, output.outputs[0])
                self._started.add(request.request_id)
                finished = delta.finished
                yield delta
                if finished:
                    return
            finished = True
            yield self._final(request, result, FinishReason.STOP)
        finally:
            self._results.pop(request.request_id, None)
            self._started.discard(request.request_id)
            if not finished:
                result.abort()

    def _sampling_params(self, request: SequenceRequest) -> Any:
        options = request.sampling
        eos = self.model_info.eos_token_ids
        common = dict(
            max_tokens=options.max_tokens, end_id=eos[0], pad_id=eos[0],
            stop_token_ids=list(options.stop_token_ids) + list(eos[1:]) or None,
            include_stop_str_in_output=True, ignore_eos=options.ignore_eos, detokenize=False)
        if options.greedy:
            return self._sampling_params_cls(top_k=1, **common)
        # TensorRT-LLM's default seed is 0 (same tokens every time): draw one when unset.
        seed = options.seed if options.seed is not None else random.getrandbits(63)
        return self._sampling_params_cls(
            temperature=options.temperature, top_k=options.top_k or None,
            top_p=options.top_p if options.top_p < 1.0 else None, seed=seed, **common)

    def _delta(self, request: SequenceRequest, completion: Any) -> TokenDelta:
        reason = _FINISH_REASONS.get(completion.finish_reason, FinishReason.NONE)
        return TokenDelta(
            request_id=request.request_id, token_ids=tuple(completion.token_ids_diff),
            finish_reason=reason, num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=len(completion.token_ids))

    def _final(self, request: SequenceRequest, result: Any, reason: FinishReason) -> TokenDelta:
        generated = len(result.outputs[0].token_ids) if result.outputs else 0
        return TokenDelta(request_id=request.request_id, token_ids=(), finish_reason=reason,
                          num_prompt_tokens=len(request.prompt_token_ids),
                          num_generated_tokens=generated)

    def cancel(self, request_id: str) -> bool:
        result = self._results.get(request_id)
        if result is None:
            return False
        result.abort()
        return True

    def load(self) -> LoadStats:
        running = len(self._started)
        return LoadStats(num_running=running, num_waiting=len(self._results) - running,
                         kv_cache_usage=0.0)

    async def shutdown(self) -> None:
        """Aborts in-flight requests and shuts TensorRT-LLM down. Idempotent."""
        for result in list(self._results.values()):
            result.abort()
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)


def _read_model_info(path: Path, config: EngineConfig) -> ModelInfo:
    """Vocabulary, EOS ids and context window from the HF checkpoint's config files."""
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(str(path))
    eos: Any = getattr(hf_config, "eos_token_id", None)
    try:
        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id or eos
    except OSError:
        pass
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    if not eos_ids or eos_ids[0] is None:
        raise ValueError(f"{path} names no eos_token_id")
    context = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    max_model_len = config.max_model_len or context
    if not max_model_len:
        raise ValueError(f"{path} names no max_position_embeddings: pass --max-model-len")
    return ModelInfo(model=config.model_name(path), max_model_len=max_model_len,
                     vocab_size=int(hf_config.vocab_size), eos_token_ids=eos_ids,
                     backend=TensorRTLLMBackend.name, max_num_seqs=config.max_num_seqs)
