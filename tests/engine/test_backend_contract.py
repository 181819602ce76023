"""The contract every engine backend keeps, run against each backend that can start here.

``torch`` always runs: the session's shared backend (SmolLM2 on CPU), or with
``LLMESH_CONTRACT_MODEL`` set, a torch backend on another checkpoint and device
(:mod:`tests.engine.contract_model`; the GPU check runs the suite so on CUDA).
``tensorrt_llm`` runs where TensorRT-LLM is installed and ``LLMESH_TRTLLM_MODEL``
names a Hugging Face checkpoint directory of the same model family.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.common.sampling import FinishReason, InvalidRequestError, SamplingOptions
from services.engine.backend import DuplicateRequestError, EngineBackend
from services.engine.config import EngineConfig
from services.engine.types import SequenceRequest, TokenDelta

from .contract_model import (
    SMOLLM2,
    ContractReference,
    contract_device,
    contract_dtype,
    contract_model,
    hf_reference,
)
from .prompts import CHAT, STORY

pytestmark = pytest.mark.model
TRTLLM_MODEL_ENV = "LLMESH_TRTLLM_MODEL"


@pytest.fixture(scope="session")
def reference() -> ContractReference:
    """What the tests expect: SmolLM2's recorded answers, or the contract model's."""
    path = contract_model()
    return SMOLLM2 if path is None else hf_reference(path)


@pytest_asyncio.fixture(scope="session")
async def hf_torch_backend() -> AsyncIterator[EngineBackend]:
    """A torch backend on ``$LLMESH_CONTRACT_MODEL`` with the shared one's
    limits (256-token context, 128-token cap)."""
    from services.engine.torch_backend.backend import TorchBackend

    from .conftest import MAX_MODEL_LEN, MAX_TOKENS_CAP

    path = contract_model()
    assert path is not None
    torch_backend = TorchBackend(EngineConfig(
        backend="torch", model_path=path, device=contract_device(), dtype=contract_dtype(),
        quantization="none", max_model_len=MAX_MODEL_LEN, max_tokens_cap=MAX_TOKENS_CAP,
        max_num_batched_tokens=64, kv_cache_bytes=64 << 20))
    await torch_backend.start()
    yield torch_backend
    await torch_backend.shutdown()


@pytest.fixture(scope="session")
def contract_torch_backend(request: pytest.FixtureRequest) -> EngineBackend:
    """The session's shared torch backend, or :func:`hf_torch_backend` when
    ``$LLMESH_CONTRACT_MODEL`` is set (the shared one is then never loaded)."""
    name = "torch_backend" if contract_model() is None else "hf_torch_backend"
    backend: EngineBackend = request.getfixturevalue(name)
    return backend


@pytest_asyncio.fixture(scope="session", params=["torch", "tensorrt_llm"])
async def backend(request: pytest.FixtureRequest,
                  contract_torch_backend: EngineBackend) -> AsyncIterator[EngineBackend]:
    if request.param == "torch":
        yield contract_torch_backend
        return
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is installed on CUDA hosts only")
    model = os.environ.get(TRTLLM_MODEL_ENV)
    if not model:
        pytest.skip(f"set {TRTLLM_MODEL_ENV} to a Hugging Face checkpoint directory")
    from services.engine.tensorrt_llm_backend.backend import TensorRTLLMBackend

    trt = TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm", model_path=Path(model),
                                          max_model_len=256, max_num_seqs=8))
    await trt.start()
    yield trt
    await trt.shutdown()


def make(request_id: str, prompt: tuple[int, ...] = CHAT, **options: object) -> SequenceRequest:
    return SequenceRequest(request_id, prompt, SamplingOptions(**options))  # type: ignore[arg-type]


async def run(backend: EngineBackend, request: SequenceRequest) -> tuple[list[int], TokenDelta]:
    """All generated tokens and the last delta."""
    tokens: list[int] = []
    async for delta in backend.generate(request):
        assert delta.request_id == request.request_id
        tokens.extend(delta.token_ids)
    return tokens, delta


async def wait_idle(backend: EngineBackend, within: float = 1.0) -> float:
    """Seconds until load() shows nothing running or waiting; fails after ``within``."""
    began = time.perf_counter()
    while time.perf_counter() - began < within:
        load = backend.load()
        if load.num_running == 0 and load.num_waiting == 0:
            return time.perf_counter() - began
        await asyncio.sleep(0.005)
    pytest.fail(f"still busy after {within} s: {backend.load()}")


async def test_model_info(backend: EngineBackend, reference: ContractReference) -> None:
    info = backend.model_info
    assert info.backend == backend.name
    assert info.vocab_size == reference.vocab_size
    assert reference.eos in info.eos_token_ids
    assert info.max_model_len == 256


def greedy_finish(reference: ContractReference) -> FinishReason:
    return FinishReason.STOP if reference.stops_by_itself else FinishReason.LENGTH


async def test_greedy_is_deterministic(backend: EngineBackend,
                                       reference: ContractReference) -> None:
    greedy = list(reference.chat_greedy)
    first, last = await run(backend, make("greedy-1", max_tokens=16))
    again, _ = await run(backend, make("greedy-2", max_tokens=16))
    assert first == again == greedy
    assert last.finish_reason is greedy_finish(reference)
    assert (last.num_prompt_tokens, last.num_generated_tokens) == (len(CHAT), len(greedy))


async def test_seeded_sampling_is_deterministic(backend: EngineBackend) -> None:
    options = dict(prompt=STORY, temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True)
    first, _ = await run(backend, make("seed-1", seed=7, **options))
    again, _ = await run(backend, make("seed-2", seed=7, **options))
    other, _ = await run(backend, make("seed-3", seed=8, **options))
    assert first == again
    assert len(first) == 12
    assert other != first


async def test_max_tokens_is_exact(backend: EngineBackend) -> None:
    tokens, last = await run(backend, make("max-tokens", prompt=STORY, max_tokens=5,
                                           ignore_eos=True))
    assert len(tokens) == 5 == last.num_generated_tokens
    assert last.finish_reason is FinishReason.LENGTH


async def test_stop_token_ids_end_the_sequence(backend: EngineBackend,
                                               reference: ContractReference) -> None:
    at = reference.stop_index  # SmolLM2: 3, "France", first occurrence at index 3
    stop = reference.chat_greedy[at]
    tokens, last = await run(backend, make("stop-id", max_tokens=16, stop_token_ids=(stop,)))
    assert tokens == list(reference.chat_greedy[:at + 1])
    assert last.finish_reason is FinishReason.STOP
    assert last.num_generated_tokens == at + 1


async def test_ignore_eos_generates_past_eos(backend: EngineBackend,
                                             reference: ContractReference) -> None:
    tokens, last = await run(backend, make("ignore-eos", max_tokens=12, ignore_eos=True))
    greedy = list(reference.chat_greedy[:12])
    assert tokens[:len(greedy)] == greedy  # SmolLM2: EOS (id 2) at index 7, kept going
    assert len(tokens) == 12
    assert last.finish_reason is FinishReason.LENGTH


async def test_cancel_mid_stream_frees_the_sequence(backend: EngineBackend) -> None:
    request = make("cancel-me", max_tokens=200, ignore_eos=True)
    received: list[int] = []
    cancelled = False
    async for delta in backend.generate(request):
        received.extend(delta.token_ids)
        if len(received) >= 2 and not cancelled:
            assert backend.load().num_running == 1
            assert backend.cancel("cancel-me") is True
            cancelled = True
    assert delta.finish_reason is FinishReason.CANCELLED
    assert 2 <= len(received) < 200
    await wait_idle(backend)
    assert backend.cancel("cancel-me") is False


async def test_cancel_during_a_long_prefill_is_prompt(backend: EngineBackend) -> None:
    # 138 prompt tokens: several prefill chunks on CPU; 110 more tokens keep a GPU busy.
    request = make("long-prompt", prompt=STORY * 6, max_tokens=110, ignore_eos=True)
    deltas: list[TokenDelta] = []

    async def consume() -> None:
        deltas.extend([delta async for delta in backend.generate(request)])

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    assert backend.cancel("long-prompt") is True
    await asyncio.wait_for(task, timeout=1.0)
    assert deltas[-1].finish_reason is FinishReason.CANCELLED
    await wait_idle(backend)


async def test_closing_the_stream_cancels(backend: EngineBackend) -> None:
    stream = backend.generate(make("close-me", max_tokens=200, ignore_eos=True))
    await anext(stream)
    await stream.aclose()
    await wait_idle(backend)


async def test_cancelling_the_consumer_task_cancels(backend: EngineBackend) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in backend.generate(make("task-me", max_tokens=200, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(backend)


async def test_concurrent_requests_both_complete(backend: EngineBackend,
                                                reference: ContractReference) -> None:
    (a, last_a), (b, last_b) = await asyncio.gather(
        run(backend, make("both-a", max_tokens=16)),
        run(backend, make("both-b", prompt=STORY, max_tokens=6, ignore_eos=True)))
    assert a == list(reference.chat_greedy)
    assert last_a.finish_reason is greedy_finish(reference)
    assert len(b) == 6 and last_b.finish_reason is FinishReason.LENGTH
    await wait_idle(backend)


@pytest.mark.parametrize(("prompt", "max_tokens", "code", "field"), [
    ((), 4, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ((5, 49152), 4, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ((5, -1), 4, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (STORY, 240, grpc.StatusCode.OUT_OF_RANGE, "sampling.max_tokens"),
])
async def test_invalid_requests_are_refused(backend: EngineBackend, prompt: tuple[int, ...],
                                            max_tokens: int, code: grpc.StatusCode,
                                            field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        await run(backend, make("invalid", prompt=prompt, max_tokens=max_tokens))
    assert (caught.value.code, caught.value.field) == (code, field)
    assert backend.load().num_waiting == 0


async def test_duplicate_request_id_is_refused(backend: EngineBackend) -> None:
    stream = backend.generate(make("dup", max_tokens=200, ignore_eos=True))
    await anext(stream)
    with pytest.raises(DuplicateRequestError):
        await run(backend, make("dup", max_tokens=2))
    await stream.aclose()
    await wait_idle(backend)
