"""The ``GenerateStream`` session's transitions (services.router.stream_session),
driven through its inbox with a host that records what it writes and refuses.

The router's own ``GenerateStream`` tests (test_router_service.py) run the
same machine over real gRPC; these pin each transition exactly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from llmesh.v1 import generation_pb2
from services.common.sampling import FinishReason, InvalidRequestError
from services.router.generation import Delta, Event, Finished, GenerationError, Usage
from services.router.routing import RoutingSession
from services.router.stream_session import (
    STREAM_DRAIN_MESSAGE,
    ClientClosed,
    ClientFailed,
    ClientSent,
    Produced,
    ProducerFailed,
    StreamGeneration,
    StreamSession,
)


@dataclass
class FakeHost:
    """Each ``open`` runs ``script`` (a list of events; ``None`` blocks forever)."""

    script: list[Event | None] = field(default_factory=list)
    draining: bool = False
    n: int = 1
    written: list[tuple[str, Event]] = field(default_factory=list)
    refused: list[grpc.StatusCode] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def open(self, start: generation_pb2.GenerateRequest, request_id: str,
             routing: RoutingSession) -> StreamGeneration:
        self.opened.append(request_id)
        return StreamGeneration(request_id, self._events(request_id), self.n)

    async def _events(self, request_id: str) -> AsyncIterator[Event]:
        try:
            for event in self.script:
                if event is None:
                    await asyncio.Event().wait()
                yield event
        finally:
            self.closed.append(request_id)

    def count_refused(self, start: generation_pb2.GenerateRequest,
                      code: grpc.StatusCode) -> None:
        self.refused.append(code)

    async def write(self, request_id: str, event: Event) -> None:
        self.written.append((request_id, event))


def start(request_id: str = "") -> ClientSent:
    return ClientSent(generation_pb2.GenerateStreamRequest(
        start=generation_pb2.GenerateRequest(prompt="hi", request_id=request_id)))


def cancel(request_id: str = "") -> ClientSent:
    return ClientSent(generation_pb2.GenerateStreamRequest(
        cancel=generation_pb2.CancelGeneration(request_id=request_id)))


DONE = Finished(FinishReason.LENGTH, "", Usage(1, 1, 0))


async def next_produced(session: StreamSession) -> Produced:
    event = await asyncio.wait_for(session.inbox.get(), 5)
    assert isinstance(event, Produced)
    return event


async def test_start_writes_each_event_then_returns_to_idle() -> None:
    host = FakeHost([Delta("a", (1,)), DONE])
    session = StreamSession(host, "s", idle_timeout_s=0)
    await session.handle(start())
    assert session.current is not None and host.opened == ["s"]
    for _ in range(2):
        produced = await next_produced(session)
        await session.handle(produced)
        assert produced.written.done()  # the producer may go on
    assert host.written == [("s", Delta("a", (1,))), ("s", DONE)]
    assert session.current is None and not session.done
    await session.handle(ClientClosed())
    assert session.done


async def test_later_generations_get_numbered_ids_unless_named() -> None:
    host = FakeHost([DONE])
    session = StreamSession(host, "s", idle_timeout_s=0)
    for message in (start(), start(), start("mine")):
        await session.handle(message)
        await session.handle(await next_produced(session))
    assert host.opened == ["s", "s.2", "mine"]
    assert session.last_id == "mine"


async def test_second_start_while_running_is_failed_precondition() -> None:
    host = FakeHost([None])
    session = StreamSession(host, "s", idle_timeout_s=0)
    await session.handle(start())
    with pytest.raises(GenerationError) as err:
        await session.handle(start("again"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'s' is still running" in err.value.message
    assert host.refused == [grpc.StatusCode.FAILED_PRECONDITION]
    assert host.opened == ["s"]  # the second was never opened


async def test_cancel_mid_way_ends_each_choice_cancelled_and_closes_the_generation() -> None:
    host = FakeHost([Delta("a", (1,)), None], n=2)
    session = StreamSession(host, "s", idle_timeout_s=0)
    await session.handle(start())
    await session.handle(await next_produced(session))
    await session.handle(cancel("s"))
    assert session.current is None
    assert host.closed == ["s"]  # the producer's generator was closed
    finals = [e for _, e in host.written if isinstance(e, Finished)]
    assert [(f.reason, f.index) for f in finals] == [(FinishReason.CANCELLED, 0),
                                                     (FinishReason.CANCELLED, 1)]


async def test_cancel_of_another_id_or_with_nothing_running_is_ignored() -> None:
    host = FakeHost([None])
    session = StreamSession(host, "s", idle_timeout_s=0)
    await session.handle(cancel())  # idle
    await session.handle(start())
    await session.handle(cancel("other"))
    assert session.current is not None and host.written == []


async def test_events_of_a_cancelled_generation_are_dropped_but_released() -> None:
    host = FakeHost([None])
    session = StreamSession(host, "s", idle_timeout_s=0)
    await session.handle(start())
    await session.handle(cancel())
    await session.handle(start())  # generation 2 runs; 1's last events still come
    written = host.written[:]
    stale = Produced(1, Delta("late", (9,)), asyncio.get_running_loop().create_future())
    await session.handle(stale)
    await session.handle(ProducerFailed(1, RuntimeError("late")))
    assert stale.written.done() and host.written == written
    assert session.current is not None and session.current.number == 2


async def test_the_running_generations_error_ends_the_call() -> None:
    session = StreamSession(FakeHost([None]), "s", idle_timeout_s=0)
    await session.handle(start())
    error = GenerationError(grpc.StatusCode.UNAVAILABLE, "engine gone")
    with pytest.raises(GenerationError) as err:
        await session.handle(ProducerFailed(1, error))
    assert err.value is error


async def test_a_message_with_no_action_is_invalid() -> None:
    message = ClientSent(generation_pb2.GenerateStreamRequest())
    with pytest.raises(GenerationError) as err:
        await StreamSession(FakeHost(), "s", idle_timeout_s=0).handle(message)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "action: set `start` or `cancel`"


async def test_an_unknown_field_in_start_is_refused_and_counted() -> None:
    message = generation_pb2.GenerateStreamRequest(start=generation_pb2.GenerateRequest())
    message.start.MergeFromString(b"\xf8\x3f\x01")  # field 1023, varint 1
    host = FakeHost()
    with pytest.raises(InvalidRequestError):
        await StreamSession(host, "s", idle_timeout_s=0).handle(ClientSent(message))
    assert host.refused == [grpc.StatusCode.INVALID_ARGUMENT] and host.opened == []


async def test_run_ends_ok_after_the_half_close_once_the_generation_finishes() -> None:
    host = FakeHost([Delta("a", (1,)), DONE])

    async def messages() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        yield start().message  # then half-close at once, the generation still running

    session = StreamSession(host, "s", idle_timeout_s=0)
    await asyncio.wait_for(session.run(messages()), 5)
    assert [e for _, e in host.written] == [Delta("a", (1,)), DONE]


async def test_run_raises_the_client_read_error() -> None:
    session = StreamSession(FakeHost(), "s", idle_timeout_s=0)
    session.inbox.put_nowait(ClientFailed(RuntimeError("call broke")))

    async def never() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        await asyncio.Event().wait()
        yield generation_pb2.GenerateStreamRequest()

    with pytest.raises(RuntimeError, match="call broke"):
        await asyncio.wait_for(session.run(never()), 5)


async def test_drain_ends_an_idle_session_unavailable_and_a_busy_one_after_its_generation(
) -> None:
    host = FakeHost([None])
    session = StreamSession(host, "s", idle_timeout_s=0)
    await session.handle(start())
    host.draining = True

    async def never() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        await asyncio.Event().wait()
        yield generation_pb2.GenerateStreamRequest()

    run = asyncio.create_task(session.run(never()))
    session.drain()
    await asyncio.sleep(0.05)
    assert not run.done()  # a generation runs: the drain waits for it
    session.inbox.put_nowait(cancel())
    with pytest.raises(GenerationError) as err:
        await asyncio.wait_for(run, 5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message == STREAM_DRAIN_MESSAGE


async def test_an_idle_session_ends_deadline_exceeded_past_its_idle_limit() -> None:
    async def never() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        await asyncio.Event().wait()
        yield generation_pb2.GenerateStreamRequest()

    session = StreamSession(FakeHost(), "s", idle_timeout_s=0.05)
    with pytest.raises(GenerationError) as err:
        await asyncio.wait_for(session.run(never()), 5)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
