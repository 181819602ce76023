"""Shared fixtures of the engine tests: SmolLM2 loaded once for the session
(loading the GGUF costs seconds) in the engine's default quantization and
shared by every torch backend the tests start (plus an fp32 copy for the
comparisons with transformers, and an int8 one on demand), one started
TorchBackend with its metrics, and a real gRPC server on a loopback port 0 in
front of it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from llmesh.v1 import engine_pb2_grpc
from services.common.model_files import default_model_path
from services.engine.config import EngineConfig
from services.engine.metrics import EngineMetrics
from services.engine.service import EngineService
from services.engine.torch_backend.backend import TorchBackend, resolve_quantization
from services.engine.torch_backend.gguf_loader import GGUFModel, load_gguf
from services.engine.torch_backend.model import LlamaModel, build_model
from services.engine.torch_backend.native import load_library
from services.engine.torch_backend.quant import resolve_quant_kernel

#: Context window of the shared backend: small, so length limits are cheap to hit.
MAX_MODEL_LEN = 256
#: Largest max_tokens the shared service accepts.
MAX_TOKENS_CAP = 128
#: Positions the shared model's RoPE tables cover (the longest context a test uses).
MAX_POSITIONS = 8192


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def gguf_model(model_path: Path) -> GGUFModel:
    return load_gguf(model_path)


@pytest.fixture(scope="session")
def gguf_q4_1(model_path: Path) -> GGUFModel:
    """The GGUF with its Q4_1 projections as raw blocks (not dequantized)."""
    return load_gguf(model_path, keep_q4_1=True)


@pytest.fixture(scope="session")
def smollm2_fp32(gguf_model: GGUFModel) -> LlamaModel:
    """SmolLM2 with dense fp32 weights (``--quantization none``)."""
    return build_model(gguf_model.config, gguf_model.state_dict, max_positions=MAX_POSITIONS)


@pytest.fixture(scope="session")
def smollm2_by_mode(gguf_q4_1: GGUFModel, request: pytest.FixtureRequest
                    ) -> Callable[..., LlamaModel]:
    """SmolLM2 in a given quantization, with or without dense prompt projections
    (``dense_prefill``, quantized modes), on a given ``quant_kernel`` (quantized
    modes; default the engine's, ``auto`` resolving to ``native`` where the
    kernels build), each built once per session."""
    built: dict[tuple[str, bool, str], LlamaModel] = {}

    def get(quantization: str, dense_prefill: bool = False,
            quant_kernel: str | None = None) -> LlamaModel:
        if quantization == "none":
            return request.getfixturevalue("smollm2_fp32")
        kernel = resolve_quant_kernel(quant_kernel or EngineConfig().quant_kernel)
        key = (quantization, dense_prefill, kernel)
        if key not in built:
            model = build_model(
                gguf_q4_1.config, gguf_q4_1.state_dict, max_positions=MAX_POSITIONS,
                quantization=quantization, q4_1=gguf_q4_1.q4_1, quant_kernel=kernel)
            if dense_prefill:
                model.add_prompt_projections()
            built[key] = model
        return built[key]

    return get


@pytest.fixture(scope="session")
def smollm2(smollm2_by_mode: Callable[..., LlamaModel]) -> LlamaModel:
    """SmolLM2 as the engine loads it by default (quantization, quantized kernel,
    dense prefill only with PyTorch's kernels) on CPU, shared by every backend of
    the session."""
    config = resolve_quantization(EngineConfig())
    dense_prefill = config.dense_prefill
    if dense_prefill is None:
        dense_prefill = resolve_quant_kernel(config.quant_kernel) == "torch"
    return smollm2_by_mode(config.quantization, dense_prefill)


@pytest.fixture(scope="session")
def engine_metrics() -> EngineMetrics:
    return EngineMetrics(CollectorRegistry())


@pytest.fixture(scope="session")
def engine_config(model_path: Path) -> EngineConfig:
    return EngineConfig(backend="torch", model_path=model_path, max_model_len=MAX_MODEL_LEN,
                        max_tokens_cap=MAX_TOKENS_CAP, max_num_batched_tokens=64,
                        kv_cache_bytes=64 << 20)


@pytest_asyncio.fixture(scope="session")
async def torch_backend(engine_config: EngineConfig, engine_metrics: EngineMetrics,
                        smollm2: LlamaModel) -> AsyncIterator[TorchBackend]:
    backend = TorchBackend(engine_config, step_observer=engine_metrics.observe_step,
                           model=smollm2)
    await backend.start()
    yield backend
    await backend.shutdown()


@pytest_asyncio.fixture(scope="session")
async def engine_service(torch_backend: TorchBackend, engine_config: EngineConfig,
                         engine_metrics: EngineMetrics) -> EngineService:
    service = EngineService(torch_backend, engine_config, engine_metrics)
    await service.start()
    return service


@pytest_asyncio.fixture(scope="session")
async def engine_address(engine_service: EngineService) -> AsyncIterator[str]:
    server = grpc.aio.server()
    engine_service.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(grace=None)


@pytest_asyncio.fixture(scope="session")
async def engine_stub(engine_address: str) -> AsyncIterator[engine_pb2_grpc.EngineServiceStub]:
    async with grpc.aio.insecure_channel(engine_address) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


@contextlib.asynccontextmanager
async def unstarted_service(
        backend: TorchBackend, metrics: EngineMetrics,
) -> AsyncIterator[tuple[EngineService, engine_pb2_grpc.EngineServiceStub]]:
    """An EngineService over ``backend`` whose ``start`` has not run (it is
    loading), served on a loopback port; yields it and a stub to it."""
    service = EngineService(backend, metrics=metrics)
    server = grpc.aio.server()
    service.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield service, engine_pb2_grpc.EngineServiceStub(channel)
    finally:
        await server.stop(grace=None)


@pytest.fixture
def kernel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Lets a test point the build at another cache or compiler (through the
    returned monkeypatch) with the library unloaded; restores both after."""
    load_library.cache_clear()
    try:
        yield monkeypatch
    finally:
        monkeypatch.undo()
        load_library.cache_clear()
        load_library()
