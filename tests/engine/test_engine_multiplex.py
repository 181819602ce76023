"""EngineService.Multiplex through a real grpc.aio server and the real model:
many requests on one call, one message per step, per-request statuses,
cancels, timeouts, a dropped call, half-close, drain, one log line each."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import grpc
import pytest
import structlog

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.sampling import FinishReason
from services.engine.metrics import EngineMetrics
from services.engine.multiplex import MultiplexCall
from services.engine.torch_backend.backend import TorchBackend
from services.engine.types import TokenDelta
from services.common.wire.engine_stream import pack_updates

from .conftest import MAX_TOKENS_CAP, unstarted_service
from .prompts import CHAT, CHAT_GREEDY, STORY
from .test_engine_service import generate, start, tokens_of, wait_not_running

pytestmark = pytest.mark.model
Stub = engine_pb2_grpc.EngineServiceStub
OK = 0


def mux_start(stream_id: int, request_id: str, prompt: tuple[int, ...] = CHAT, *,
              timeout_ms: int = 0, **sampling: object) -> engine_pb2.MultiplexStart:
    return engine_pb2.MultiplexStart(
        stream_id=stream_id, timeout_ms=timeout_ms, request=engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(**sampling)))  # type: ignore[arg-type]


class Call:
    """A Multiplex call driven by the test: ``send`` messages, ``until`` ends."""

    def __init__(self, stub: Stub) -> None:
        self._outgoing: asyncio.Queue[engine_pb2.MultiplexRequest | None] = asyncio.Queue()
        self.call = stub.Multiplex(self._requests())
        self.messages: list[engine_pb2.MultiplexResponse] = []
        self.updates: dict[int, list[engine_pb2.SequenceUpdate]] = {}

    async def _requests(self) -> AsyncIterator[engine_pb2.MultiplexRequest]:
        while (message := await self._outgoing.get()) is not None:
            yield message

    def send(self, *starts: engine_pb2.MultiplexStart, cancels: tuple[int, ...] = ()) -> None:
        self._outgoing.put_nowait(engine_pb2.MultiplexRequest(starts=starts, cancels=cancels))

    def half_close(self) -> None:
        self._outgoing.put_nowait(None)

    def drop(self) -> None:
        """Cancels the call (its request iterator ends first, quietly)."""
        self.half_close()
        self.call.cancel()

    def ended(self, stream_id: int) -> bool:
        updates = self.updates.get(stream_id, [])
        return bool(updates) and bool(updates[-1].finish_reason or updates[-1].status_code)

    async def read_one(self) -> None:
        message = await self.call.read()
        assert message is not grpc.aio.EOF, "the call ended early"
        self.messages.append(message)
        for update in message.updates:
            self.updates.setdefault(update.stream_id, []).append(update)

    async def until(self, *stream_ids: int, timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while not all(self.ended(s) for s in stream_ids):
                await self.read_one()

    def ids(self, stream_id: int) -> list[int]:
        return [t for u in self.updates.get(stream_id, []) for t in u.token_ids]

    def last(self, stream_id: int) -> engine_pb2.SequenceUpdate:
        return self.updates[stream_id][-1]


async def test_many_requests_share_one_call_and_one_message_per_step(engine_stub: Stub) -> None:
    solo = tokens_of(await generate(engine_stub, start("solo-story", STORY, max_tokens=24,
                                                       ignore_eos=True)))
    call = Call(engine_stub)
    call.send(*[mux_start(i, f"mux-{i}", max_tokens=16) for i in (1, 2, 3)],
              mux_start(4, "mux-story", STORY, max_tokens=24, ignore_eos=True))
    await call.until(1, 2, 3, 4)
    for i in (1, 2, 3):
        assert call.ids(i) == list(CHAT_GREEDY)
        last = call.last(i)
        assert (last.finish_reason, last.status_code) == (common_pb2.FINISH_REASON_STOP, OK)
        assert last.usage.completion_tokens == len(CHAT_GREEDY)
        assert last.usage.prompt_tokens == len(CHAT)
    assert call.ids(4) == solo
    # The steps of the batch of four arrive as one message each, not four.
    assert max(len(m.updates) for m in call.messages) == 4
    assert len(call.messages) < sum(len(u) for u in call.updates.values())
    call.drop()
    await wait_not_running(engine_stub)


def _tasks_and_queues() -> tuple[int, int]:
    gc.collect()
    return len(asyncio.all_tasks()), sum(type(o) is asyncio.Queue for o in gc.get_objects())


async def test_open_requests_cost_the_call_no_task_and_no_queue(engine_stub: Stub) -> None:
    """Issue 32: the engine core hands each step's deltas to the call's outbox
    (one callback per step), not through a task and a queue per request. The
    server runs in this process, so its loop's tasks and queues are counted
    with the call idle and with eight requests streaming on it."""
    call = Call(engine_stub)
    call.send(mux_start(1, "warm", max_tokens=1))
    await call.until(1)
    idle = _tasks_and_queues()
    streams = range(10, 18)
    call.send(*[mux_start(i, f"open-{i}", max_tokens=MAX_TOKENS_CAP, ignore_eos=True)
                for i in streams])
    async with asyncio.timeout(60):
        while not all(call.ids(i) for i in streams):
            await call.read_one()
    busy = _tasks_and_queues()
    call.send(cancels=tuple(streams))
    await call.until(*streams)
    assert all(call.last(i).finish_reason == common_pb2.FINISH_REASON_CANCELLED
               for i in streams)
    # The old path held one task and one queue per request (+8 each here).
    assert busy[0] - idle[0] <= 1 and busy[1] - idle[1] <= 1, (idle, busy)
    call.drop()
    await wait_not_running(engine_stub)


async def test_a_cancel_ends_only_its_request(engine_stub: Stub) -> None:
    call = Call(engine_stub)
    call.send(mux_start(1, "keep", max_tokens=16),
              mux_start(2, "cancel-me", max_tokens=MAX_TOKENS_CAP, ignore_eos=True))
    while len(call.ids(2)) < 2:
        await call.read_one()
    call.send(cancels=(2, 99))  # 99 is unknown: ignored
    await call.until(1, 2)
    assert call.ids(1) == list(CHAT_GREEDY)
    last = call.last(2)
    assert last.finish_reason == common_pb2.FINISH_REASON_CANCELLED and last.status_code == OK
    assert 2 <= last.usage.completion_tokens < MAX_TOKENS_CAP
    assert last.usage.completion_tokens == len(call.ids(2))
    await wait_not_running(engine_stub)
    call.drop()


async def test_a_bad_request_fails_alone_with_its_status(engine_stub: Stub) -> None:
    call = Call(engine_stub)
    call.send(mux_start(1, "bad-id", (5, 49152)),
              mux_start(2, "good", max_tokens=4),
              mux_start(3, "", max_tokens=4),
              mux_start(4, "too-long", STORY * 10, max_tokens=MAX_TOKENS_CAP),
              mux_start(5, "bad-top-p", top_p=1.5))
    await call.until(1, 2, 3, 4, 5)
    assert call.last(1).status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert call.last(1).status_message.startswith("prompt_token_ids:")
    assert call.last(3).status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert call.last(3).status_message.startswith("request.request_id:")
    assert call.last(4).status_code == grpc.StatusCode.OUT_OF_RANGE.value[0]
    assert call.last(5).status_message.startswith("sampling.top_p:")
    assert call.last(2).finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(call.ids(2)) == 4
    # A request id in flight is refused; the call lives on.
    call.send(mux_start(6, "long", max_tokens=MAX_TOKENS_CAP, ignore_eos=True))
    call.send(mux_start(7, "long"))
    await call.until(7)
    assert call.last(7).status_code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert "'long'" in call.last(7).status_message
    call.send(cancels=(6,))
    await call.until(6)
    assert call.last(6).finish_reason == common_pb2.FINISH_REASON_CANCELLED
    call.drop()
    await wait_not_running(engine_stub)


async def test_cancelling_a_refused_duplicate_never_cancels_the_request_owning_the_id(
        engine_stub: Stub) -> None:
    call = Call(engine_stub)
    call.send(mux_start(1, "dup-owner", max_tokens=24, ignore_eos=True))
    await call.read_one()
    call.send(mux_start(2, "dup-owner", max_tokens=24, ignore_eos=True), cancels=(2,))
    await call.until(1, 2)
    assert call.last(2).status_code in (grpc.StatusCode.ALREADY_EXISTS.value[0], OK)
    last = call.last(1)
    assert (last.finish_reason, last.status_code) == (common_pb2.FINISH_REASON_LENGTH, OK)
    assert len(call.ids(1)) == 24
    call.drop()
    await wait_not_running(engine_stub)


@pytest.mark.parametrize("same_message", [True, False])
async def test_a_cancelled_request_id_may_start_again_at_once(engine_stub: Stub,
                                                               same_message: bool) -> None:
    # Issue 13 QA (Q2): a client that reuses its request id right after a
    # cancel (the router does so after a stop string) got ALREADY_EXISTS
    # while the engine had not yet freed the old sequence.
    call = Call(engine_stub)
    call.send(mux_start(1, "reused", max_tokens=MAX_TOKENS_CAP, ignore_eos=True))
    await call.read_one()
    if same_message:
        call.send(mux_start(2, "reused", max_tokens=16), cancels=(1,))
    else:
        call.send(cancels=(1,))
        call.send(mux_start(2, "reused", max_tokens=16))
    await call.until(1, 2)
    assert call.last(1).finish_reason == common_pb2.FINISH_REASON_CANCELLED
    last = call.last(2)
    assert (last.finish_reason, last.status_code) == (common_pb2.FINISH_REASON_STOP, OK)
    assert call.ids(2) == list(CHAT_GREEDY)
    call.drop()
    await wait_not_running(engine_stub)


async def test_a_start_cancelled_in_its_own_message_logs_its_request_id(
        engine_stub: Stub) -> None:
    with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]) as logs:
        call = Call(engine_stub)
        call.send(mux_start(1, "born-cancelled", max_tokens=8), cancels=(1,))
        await call.until(1)
        await asyncio.sleep(0.05)
    assert call.last(1).finish_reason == common_pb2.FINISH_REASON_CANCELLED
    lines = [line for line in logs if line["event"] == "request_finished"
             and line.get("request_id") == "born-cancelled"]
    assert len(lines) == 1 and lines[0]["cancelled_by"] == "cancel_message"
    call.drop()


async def test_a_stream_id_reused_while_open_ends_the_call(engine_stub: Stub) -> None:
    call = Call(engine_stub)
    call.send(mux_start(1, "first", max_tokens=MAX_TOKENS_CAP, ignore_eos=True))
    await call.read_one()
    call.send(mux_start(1, "second", max_tokens=4))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.until(1)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("starts: stream_id 1 is still open")
    await wait_not_running(engine_stub, within=5)


async def test_timeout_ms_ends_the_request_with_deadline_exceeded(engine_stub: Stub) -> None:
    call = Call(engine_stub)
    call.send(mux_start(1, "slow", max_tokens=MAX_TOKENS_CAP, ignore_eos=True, timeout_ms=300),
              mux_start(2, "fast", max_tokens=4))
    await call.until(1, 2)
    last = call.last(1)
    assert last.status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "timeout_ms (300 ms)" in last.status_message
    assert len(call.ids(1)) < MAX_TOKENS_CAP
    assert call.last(2).finish_reason == common_pb2.FINISH_REASON_LENGTH
    await wait_not_running(engine_stub)
    call.drop()


async def test_dropping_the_call_cancels_every_request_on_it(engine_stub: Stub,
                                                             engine_metrics: EngineMetrics
                                                             ) -> None:
    call = Call(engine_stub)
    call.send(*[mux_start(i, f"drop-{i}", max_tokens=MAX_TOKENS_CAP, ignore_eos=True)
                for i in (1, 2, 3)])
    message = await call.call.read()
    assert message.updates
    assert (await engine_stub.GetLoad(engine_pb2.GetLoadRequest())).num_running == 3
    call.call.cancel()  # no half-close first: the call just goes
    await wait_not_running(engine_stub, within=5)


async def test_half_close_ends_the_call_after_its_requests(engine_stub: Stub) -> None:
    call = Call(engine_stub)
    call.send(mux_start(1, "hc-1", max_tokens=8, ignore_eos=True),
              mux_start(2, "hc-2", max_tokens=12, ignore_eos=True))
    call.half_close()
    await call.until(1, 2)
    assert len(call.ids(1)) == 8 and len(call.ids(2)) == 12
    async with asyncio.timeout(5):
        assert await call.call.read() is grpc.aio.EOF
    assert await call.call.code() == grpc.StatusCode.OK


async def test_loading_and_draining_refuse_each_start(torch_backend: TorchBackend,
                                                      engine_metrics: EngineMetrics) -> None:
    async with unstarted_service(torch_backend, engine_metrics) as (service, stub):
        call = Call(stub)
        call.send(mux_start(1, "while-loading", max_tokens=1))
        await call.until(1)
        assert call.last(1).status_code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "loading" in call.last(1).status_message
        await service.start()
        call.send(mux_start(2, "ready", max_tokens=1))
        await call.until(2)
        assert call.last(2).finish_reason == common_pb2.FINISH_REASON_LENGTH
        call.send(mux_start(3, "running", max_tokens=MAX_TOKENS_CAP, ignore_eos=True))
        while not call.ids(3):
            await call.read_one()
        await service.drain()
        call.send(mux_start(4, "while-draining", max_tokens=1))
        await call.until(3, 4)
        assert call.last(4).status_code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "draining" in call.last(4).status_message
        # The request that ran when the drain began finished whole, then the
        # engine ended the call (OK) by itself: the drain waits for no caller.
        assert call.last(3).finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(call.ids(3)) == MAX_TOKENS_CAP
        async with asyncio.timeout(5):
            assert await call.call.read() is grpc.aio.EOF
            assert await call.call.code() == grpc.StatusCode.OK
        call.half_close()


async def test_every_request_on_a_call_writes_one_log_line(engine_stub: Stub) -> None:
    with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]) as logs:
        call = Call(engine_stub)
        call.send(mux_start(1, "line-stop", max_tokens=16),
                  mux_start(2, "line-cancel", max_tokens=MAX_TOKENS_CAP, ignore_eos=True),
                  mux_start(3, "line-deadline", max_tokens=MAX_TOKENS_CAP, ignore_eos=True,
                            timeout_ms=200),
                  mux_start(4, "line-dropped", max_tokens=MAX_TOKENS_CAP, ignore_eos=True))
        call.send(cancels=(2,))
        await call.until(1, 2, 3)
        call.call.cancel()
        await wait_not_running(engine_stub, within=5)
        await asyncio.sleep(0.1)
    finished = {line["request_id"]: line for line in logs
                if line["event"] == "request_finished"
                and line.get("request_id", "").startswith("line-")}
    assert sorted(finished) == ["line-cancel", "line-deadline", "line-dropped", "line-stop"]
    assert finished["line-stop"]["outcome"] == "stop"
    assert finished["line-cancel"]["cancelled_by"] == "cancel_message"
    assert finished["line-deadline"]["cancelled_by"] == "deadline_exceeded"
    assert finished["line-dropped"]["cancelled_by"] == "call_dropped"


def test_the_outbox_merges_a_requests_pending_updates() -> None:
    async def run() -> list[engine_pb2.MultiplexResponse]:
        call = MultiplexCall(to_request=None, request_sink=None,  # type: ignore[arg-type]
                             refusal=lambda: None)
        for stream_id, delta in ((7, TokenDelta("a", (1, 2), FinishReason.NONE, 5, 2, 3)),
                                 (8, TokenDelta("b", (9,), FinishReason.NONE, 4, 1)),
                                 (7, TokenDelta("a", (3,), FinishReason.STOP, 5, 3, 3))):
            call.outbox.put((stream_id, delta.index), delta)
        assert await call.outbox.wait()
        return list(pack_updates(call.outbox.take_all()))

    (response,) = asyncio.run(run())
    assert [(u.stream_id, list(u.token_ids)) for u in response.updates] == [(7, [1, 2, 3]),
                                                                           (8, [9])]
    first = response.updates[0]
    assert first.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (first.usage.completion_tokens, first.usage.cached_prompt_tokens) == (3, 3)
