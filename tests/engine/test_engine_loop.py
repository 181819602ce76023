"""The torch request loop on a tiny random-weight Llama (same code, milliseconds a
step): scheduling order, cancels, limits, errors and the worker thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from services.common.sampling import FinishReason, Priority, SamplingOptions
from services.engine.backend import DuplicateRequestError, EngineUnavailableError, QueueFullError
from services.engine.torch_backend.engine_loop import EngineLoop
from services.engine.torch_backend.gguf_loader import LlamaConfig
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner
from services.engine.types import EngineRequest, TokenDelta

TINY = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=64, vocab_size=64, rope_theta=10000.0,
                   rms_norm_eps=1e-5, context_length=512, tie_word_embeddings=True,
                   bos_token_id=None, eos_token_ids=(1,))
#: max_tokens of a request that must still be running when the test acts on it.
LONG = 400


@pytest.fixture(scope="module")
def tiny_runner() -> ModelRunner:
    torch.manual_seed(0)
    model = LlamaModel(TINY)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(std=0.2)
    return ModelRunner(model.eval().requires_grad_(False), torch.device("cpu"), torch.float32)


class Recorder:
    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, seconds: float) -> None:
        assert seconds >= 0
        self.threads.append(threading.current_thread().name)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def make_loop(tiny_runner: ModelRunner, recorder: Recorder) -> Iterator:
    loops: list[EngineLoop] = []

    def make(**kwargs: object) -> EngineLoop:
        options = dict(eos_token_ids=TINY.eos_token_ids, max_model_len=512, step_observer=recorder)
        options.update(kwargs)
        loop = EngineLoop(tiny_runner, **options)  # type: ignore[arg-type]
        loop.start()
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.stop()


def request(request_id: str, prompt: int = 4, max_tokens: int = 8,
            priority: Priority = Priority.INTERACTIVE) -> EngineRequest:
    return EngineRequest(request_id, tuple(range(2, 2 + prompt)),
                         SamplingOptions(max_tokens=max_tokens, ignore_eos=True), priority)


async def deltas(queue: asyncio.Queue[TokenDelta]) -> AsyncIterator[TokenDelta]:
    while True:
        delta = await asyncio.wait_for(queue.get(), timeout=10)
        yield delta
        if delta.finished:
            return


async def collect(queue: asyncio.Queue[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in deltas(queue)]


async def test_steps_run_on_the_worker_thread(make_loop, recorder: Recorder) -> None:
    loop = make_loop()
    out = await collect(loop.submit(request("a", max_tokens=3), asyncio.get_running_loop()))
    assert [len(d.token_ids) for d in out] == [1, 1, 1]
    assert recorder.threads == ["engine-step"] * 3
    assert threading.current_thread().name != "engine-step"


async def test_prefill_is_chunked(make_loop, recorder: Recorder) -> None:
    loop = make_loop(prefill_chunk_size=8)
    out = await collect(loop.submit(request("a", prompt=20, max_tokens=2),
                                    asyncio.get_running_loop()))
    assert sum(len(d.token_ids) for d in out) == 2
    assert len(recorder.threads) == 4  # prefill 8 + 8 + 4 (samples token 1), decode token 2


async def test_full_context_finishes_with_length(make_loop) -> None:
    loop = make_loop(max_model_len=12)
    out = await collect(loop.submit(request("a", prompt=4, max_tokens=100),
                                    asyncio.get_running_loop()))
    assert out[-1].finish_reason is FinishReason.LENGTH
    assert out[-1].num_generated_tokens == 8 == sum(len(d.token_ids) for d in out)


async def test_priority_then_arrival_order(make_loop) -> None:
    loop = make_loop()
    aio = asyncio.get_running_loop()
    first = loop.submit(request("first", max_tokens=LONG), aio)
    await first.get()  # "first" is running; the rest queue behind it
    queues = {
        "batch-1": loop.submit(request("batch-1", max_tokens=2, priority=Priority.BATCH), aio),
        "batch-2": loop.submit(request("batch-2", max_tokens=2, priority=Priority.BATCH), aio),
        "inter-1": loop.submit(request("inter-1", max_tokens=2), aio),
        "inter-2": loop.submit(request("inter-2", max_tokens=2), aio),
    }
    assert loop.load().num_waiting == 4
    finished: list[str] = []

    async def watch(name: str, queue: asyncio.Queue[TokenDelta]) -> None:
        await collect(queue)
        finished.append(name)

    await asyncio.gather(watch("first", first), *(watch(n, q) for n, q in queues.items()))
    assert finished == ["first", "inter-1", "inter-2", "batch-1", "batch-2"]


async def test_cancel_waiting_leaves_the_queue_at_once(make_loop) -> None:
    loop = make_loop()
    aio = asyncio.get_running_loop()
    running = loop.submit(request("running", max_tokens=LONG), aio)
    await running.get()
    waiting = loop.submit(request("waiting"), aio)
    assert loop.load().num_waiting == 1
    assert loop.cancel("waiting") is True
    assert loop.load().num_waiting == 0
    out = await collect(waiting)
    assert [(d.token_ids, d.finish_reason) for d in out] == [((), FinishReason.CANCELLED)]
    assert loop.cancel("waiting") is False
    assert loop.cancel("running") is True
    last = (await collect(running))[-1]
    assert last.finish_reason is FinishReason.CANCELLED
    assert loop.load().num_running == 0
    assert loop.load().kv_cache_usage == 0.0


async def test_queue_limit_and_duplicate_ids(make_loop) -> None:
    loop = make_loop(max_num_waiting=1)
    aio = asyncio.get_running_loop()
    running = loop.submit(request("a", max_tokens=LONG), aio)
    await running.get()
    assert loop.load().num_running == 1
    assert 0 < loop.load().kv_cache_usage <= 1
    loop.submit(request("b"), aio)
    with pytest.raises(QueueFullError, match="limit 1"):
        loop.submit(request("c"), aio)
    with pytest.raises(DuplicateRequestError, match="'a'"):
        loop.submit(request("a"), aio)
    loop.cancel("a")
    loop.cancel("b")


async def test_failed_step_fails_only_that_request(make_loop) -> None:
    loop = make_loop()
    aio = asyncio.get_running_loop()
    bad = EngineRequest("bad", (TINY.vocab_size + 5,), SamplingOptions(max_tokens=2))
    out = await collect(loop.submit(bad, aio))
    assert out[-1].finish_reason is FinishReason.ERROR
    assert "IndexError" in out[-1].error
    good = await collect(loop.submit(request("good", max_tokens=2), aio))
    assert good[-1].finish_reason is FinishReason.LENGTH


async def test_stop_fails_leftovers_and_refuses_new_work(make_loop) -> None:
    loop = make_loop()
    aio = asyncio.get_running_loop()
    running = loop.submit(request("running", max_tokens=LONG), aio)
    await running.get()
    waiting = loop.submit(request("waiting"), aio)
    await asyncio.to_thread(loop.stop)
    for queue in (running, waiting):
        last = (await collect(queue))[-1]
        assert (last.finish_reason, last.error) == (FinishReason.ERROR, "the engine shut down")
    with pytest.raises(EngineUnavailableError):
        loop.submit(request("late"), aio)
    assert loop.load().num_running == loop.load().num_waiting == 0
