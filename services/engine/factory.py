"""Builds the backend an :class:`EngineConfig` names (imports it lazily), and
refuses the options it cannot start with before importing it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.engine.config import BACKEND_NAMES, EngineConfig

if TYPE_CHECKING:
    from services.engine.backend import EngineBackend
    from services.engine.torch_backend.engine_core import StepObserver


def check_backend_options(config: EngineConfig) -> None:
    """The refusals of ``config.backend`` that need no backend instance, run
    before it is imported: for ``torch``, its
    :func:`~services.engine.torch_backend.start_checks.check_config` then
    :func:`~services.engine.torch_backend.start_checks.check_model_files`
    (torch itself is not imported for a CPU start); ``tensorrt_llm`` checks
    on its instance (``check_available``, ``check_model_files``), and an
    unknown name is :func:`create_backend`'s to refuse.

    Raises:
      ValueError: options or a model path the backend refuses.
      FileNotFoundError: a model path with nothing (or no weights) there.
    """
    if config.backend == "torch":
        from services.engine.torch_backend.start_checks import check_config, check_model_files

        check_config(config)
        check_model_files(config)


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
