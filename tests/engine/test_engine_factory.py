"""Backend selection, and the tensorrt_llm backend on a machine without TensorRT-LLM."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.engine.backend import EngineUnavailableError
from services.engine.config import EngineConfig
from services.engine.factory import create_backend
from services.engine.tensorrt_llm_backend.backend import TensorRTLLMBackend
from services.engine.torch_backend.backend import TorchBackend

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def test_create_backend_by_name() -> None:
    assert isinstance(create_backend(EngineConfig(backend="torch")), TorchBackend)
    trt = create_backend(EngineConfig(backend="tensorrt_llm", model_path=Path("/models/x")))
    assert isinstance(trt, TensorRTLLMBackend)
    with pytest.raises(ValueError, match="unknown backend 'vllm'"):
        create_backend(EngineConfig(backend="vllm"))


def test_served_model_name_defaults_to_the_file_stem() -> None:
    config = EngineConfig()
    assert config.model_name(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert config.model_name(Path("/models/Llama-3.1-8B")) == "Llama-3.1-8B"
    assert EngineConfig(served_model_name="m").model_name(Path("/x/a.gguf")) == "m"


async def test_unstarted_backends_refuse_work() -> None:
    for backend in (TorchBackend(), TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm"))):
        with pytest.raises(EngineUnavailableError):
            backend.model_info  # noqa: B018
        assert backend.load().num_running == 0
        assert backend.cancel("nothing") is False


@pytest.mark.skipif(HAS_TRTLLM, reason="TensorRT-LLM is installed here")
async def test_tensorrt_llm_absent_gives_a_clear_error() -> None:
    backend = TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm", model_path=Path("/m")))
    with pytest.raises(EngineUnavailableError, match="needs TensorRT-LLM on a CUDA host"):
        await backend.start()


@pytest.mark.skipif(not HAS_TRTLLM, reason="needs TensorRT-LLM to get past the import")
async def test_tensorrt_llm_refuses_a_gguf() -> None:
    backend = TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm",
                                              model_path=Path("/m/model.Q4_1.gguf")))
    with pytest.raises(ValueError, match="GGUF"):
        await backend.start()
