"""Builds the backend an :class:`EngineConfig` names (imports it lazily)."""

from __future__ import annotations

from services.engine.backend import EngineBackend
from services.engine.config import BACKEND_NAMES, EngineConfig
from services.engine.torch_backend.engine_core import StepObserver


def create_backend(config: EngineConfig,
                   step_observer: StepObserver | None = None) -> EngineBackend:
    """A new, not yet started backend for ``config.backend``.

    Args:
      config: engine options.
      step_observer: per-step stats callback (the torch engine's steps,
        TensorRT-LLM's iterations).

    Raises:
      ValueError: an unknown backend name, or options the backend cannot start
        with (e.g. the torch backend's ``check_config``).
    """
    if config.backend == "torch":
        from services.engine.torch_backend.backend import TorchBackend

        return TorchBackend(config, step_observer=step_observer)
    if config.backend == "tensorrt_llm":
        from services.engine.tensorrt_llm_backend.backend import TensorRTLLMBackend

        return TensorRTLLMBackend(config, step_observer=step_observer)
    raise ValueError(f"unknown backend {config.backend!r}; choose one of {BACKEND_NAMES}")
