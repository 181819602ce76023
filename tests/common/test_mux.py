"""The stream kit (services.common.mux) over a real loopback gRPC call: the
engine's ``Multiplex`` RPC served by a test servicer on the kit's server, and
called by the kit's client, both speaking services.common.wire.engine_stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from llmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.mux import MuxClient, MuxServer, ProtocolViolation, StreamInbox
from services.common.sampling import FinishReason
from services.common.wire.engine_stream import (
    EngineStart,
    StreamCancel,
    TokenDelta,
    merge_deltas,
    pack_requests,
    pack_updates,
    unpack_requests,
    unpack_updates,
)


class _Error(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Servicer(engine_pb2_grpc.EngineServiceServicer):
    """Multiplex on the kit's server: each start is answered by ``respond``
    (called synchronously in the handler, so its updates are all pending
    before the writer runs); a start that reuses an open id is a violation."""

    def __init__(self, respond: Callable[[MuxServer, EngineStart], None]) -> None:
        self.respond = respond
        self.received: list[engine_pb2.MultiplexRequest] = []
        self.open: set[int] = set()
        self.proceed = asyncio.Event()
        self.proceed.set()

    async def Multiplex(self, request_iterator, context):  # noqa: N802 (gRPC name)
        server: MuxServer[tuple[int, int], TokenDelta] = MuxServer(merge=merge_deltas,
                                                                   pack=pack_updates)

        async def handle(message: engine_pb2.MultiplexRequest) -> None:
            self.received.append(message)
            starts, cancels = unpack_requests(message)
            for start in starts:
                if start.stream_id in self.open:
                    raise ProtocolViolation(f"stream_id {start.stream_id} is still open")
                self.open.add(start.stream_id)
                self.respond(server, start)
            for cancel in cancels:
                self.open.discard(cancel.stream_id)
                server.outbox.put((cancel.stream_id, 0), _delta(finish=FinishReason.CANCELLED))
            await self.proceed.wait()

        async def finish() -> None:
            return None

        async for response in server.serve(request_iterator, context, handle=handle,
                                           finish=finish):
            yield response


def _delta(ids: tuple[int, ...] = (), finish: FinishReason = FinishReason.NONE, *,
           index: int = 0) -> TokenDelta:
    return TokenDelta("", ids, finish, 2, len(ids), index=index)


class _Inbox(StreamInbox[int, TokenDelta]):
    """A receiver whose stream ends with its first finished update."""

    def __init__(self) -> None:
        super().__init__(merge_deltas)

    def deliver(self, update: TokenDelta) -> bool:
        last = update.finished or update.status is not grpc.StatusCode.OK
        self.put(update.index, update, last=last)
        return last


@contextlib.asynccontextmanager
async def _serving(servicer: _Servicer) -> AsyncIterator[tuple[grpc.aio.Server, grpc.aio.Channel]]:
    """``servicer`` on a loopback port, and a channel to it (both closed after)."""
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, channel
    finally:
        await channel.close()
        await server.stop(None)


def _client(channel: grpc.aio.Channel) -> MuxClient[EngineStart | StreamCancel, TokenDelta]:
    return MuxClient(engine_pb2_grpc.EngineServiceStub(channel).Multiplex(),
                     pack=pack_requests, unpack=unpack_updates, make_error=_Error,
                     service="engine", target="loopback")


def _start(stream_id: int) -> EngineStart:
    return EngineStart(stream_id, engine_pb2.EngineRequest(request_id=f"r{stream_id}",
                                                           prompt_token_ids=[1, 2]))


def _ids(server: MuxServer, start: EngineStart, ids: tuple[int, ...], *,
         finish: bool = True) -> None:
    for i, token in enumerate(ids):
        last = finish and i == len(ids) - 1
        server.outbox.put((start.stream_id, 0),
                          _delta((token,), FinishReason.STOP if last else FinishReason.NONE))


async def test_the_writers_send_what_is_queued_in_one_message_and_updates_merge():
    servicer = _Servicer(lambda server, start: _ids(server, start, (start.stream_id, 7, 8)))
    async with _serving(servicer) as (server, channel):
        mux = _client(channel)
        try:
            inboxes = {sid: _Inbox() for sid in (1, 2, 3)}
            for sid, inbox in inboxes.items():  # one loop turn: the writer runs once
                mux.open(sid, inbox, _start(sid))
            for sid, inbox in inboxes.items():
                _, update = await inbox.read()
                assert (update.token_ids, update.finish_reason) == ((sid, 7, 8), FinishReason.STOP)
            assert [len(m.starts) for m in servicer.received] == [3]
            assert mux.open_streams == 0  # each last update forgot its stream
        finally:
            await mux.close()


async def test_a_flushed_start_is_on_the_call_before_the_caller_goes_on_and_order_holds():
    """``flush`` hands what is queued to the call before the caller's next step
    (not at its next wait); what is queued meanwhile goes in the next batch,
    in the order it was queued."""
    servicer = _Servicer(lambda server, start: _ids(server, start, (start.stream_id,)))
    async with _serving(servicer) as (server, channel):
        mux = _client(channel)
        try:
            inboxes = {sid: _Inbox() for sid in (1, 2, 3)}
            await mux.flush()  # nothing queued: nothing to do
            mux.open(1, inboxes[1], _start(1))
            assert mux.queued == 1
            await mux.flush()
            assert mux.queued == 0
            mux.open(2, inboxes[2], _start(2))
            mux.open(3, inboxes[3], _start(3))
            await mux.flush()
            for sid, inbox in inboxes.items():
                _, update = await inbox.read()
                assert update.token_ids == (sid,)
            assert [[s.stream_id for s in m.starts] for m in servicer.received] == [[1], [2, 3]]
        finally:
            await mux.close()


async def test_a_slow_reader_gets_the_updates_merged_per_choice():
    servicer = _Servicer(lambda server, start: None)
    async with _serving(servicer) as (server, channel):
        mux = _client(channel)
        try:
            servicer.respond = lambda server, start: [
                server.outbox.put((start.stream_id, i % 2), _delta((i,), index=i % 2))
                for i in range(6)]
            inbox = _Inbox()
            mux.open(1, inbox, _start(1))
            while not inbox.has_unread():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert [(key, u.token_ids, u.index) for key, u in
                    [await inbox.read() for _ in range(2)]] == [(0, (0, 2, 4), 0),
                                                                (1, (1, 3, 5), 1)]
            mux.send(StreamCancel(1))
            _, update = await inbox.read()
            assert update.finish_reason is FinishReason.CANCELLED
        finally:
            await mux.close()


class _ReadsLogged:
    """A real call whose ``read`` notes in ``events`` when the reader posts it."""

    def __init__(self, call: grpc.aio.StreamStreamCall, events: list[str]) -> None:
        self._call, self._events = call, events

    def read(self):  # noqa: ANN201 - the call's own awaitable
        self._events.append("read posted")
        return self._call.read()

    def __getattr__(self, name: str):  # noqa: ANN204 - write, cancel: the call's
        return getattr(self._call, name)


async def test_a_stream_woken_by_an_update_runs_before_the_next_read_is_posted():
    # A token's way to its client (the router's pipeline, then the write) must
    # not wait behind the reader posting its next read on the call.
    servicer = _Servicer(lambda server, start: _ids(server, start, (5,), finish=False))
    async with _serving(servicer) as (server, channel):
        events: list[str] = []
        mux = MuxClient(_ReadsLogged(engine_pb2_grpc.EngineServiceStub(channel).Multiplex(),
                                     events),
                        pack=pack_requests, unpack=unpack_updates, make_error=_Error,
                        service="engine", target="loopback")
        try:
            inbox = _Inbox()
            mux.open(1, inbox, _start(1))

            async def consume() -> tuple[int, ...]:
                _, update = await inbox.read()
                events.append("stream ran")
                return update.token_ids

            assert await asyncio.wait_for(consume(), 5) == (5,)
            while len(events) < 3:
                await asyncio.sleep(0.01)
            assert events[:3] == ["read posted", "stream ran", "read posted"]
        finally:
            await mux.close()


async def test_a_duplicate_stream_id_ends_the_call_invalid_argument_after_what_was_queued():
    servicer = _Servicer(lambda server, start: _ids(server, start, (5,), finish=False))
    async with _serving(servicer) as (server, channel):
        call = engine_pb2_grpc.EngineServiceStub(channel).Multiplex()
        await call.write(pack_requests([_start(1)])[0])
        await call.write(pack_requests([_start(1)])[0])
        first = await call.read()
        assert [(u.stream_id, list(u.token_ids)) for u in first.updates] == [(1, [5])]
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stream_id 1 is still open" in ended.value.details()


async def test_a_bug_in_the_handler_ends_the_call_internal():
    def respond(server: MuxServer, start: EngineStart) -> None:
        raise KeyError("oops")

    async with _serving(_Servicer(respond)) as (server, channel):
        call = engine_pb2_grpc.EngineServiceStub(channel).Multiplex()
        await call.write(pack_requests([_start(1)])[0])
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
        assert ended.value.code() == grpc.StatusCode.INTERNAL
        assert "KeyError" in ended.value.details()


async def test_a_broken_call_fails_every_open_stream_unavailable():
    servicer = _Servicer(lambda server, start: None)
    async with _serving(servicer) as (server, channel):
        failures: list[str] = []
        mux = MuxClient(engine_pb2_grpc.EngineServiceStub(channel).Multiplex(),
                        pack=pack_requests, unpack=unpack_updates, make_error=_Error,
                        service="engine", target="loopback", on_failed=failures.append)
        try:
            inboxes = [_Inbox(), _Inbox()]
            for sid, inbox in enumerate(inboxes, 1):
                mux.open(sid, inbox, _start(sid))
            while len(servicer.received) < 1:
                await asyncio.sleep(0.01)
            await server.stop(None)  # the peer goes away
            for inbox in inboxes:
                with pytest.raises(_Error) as failed:
                    await asyncio.wait_for(inbox.read(), 5)
                assert failed.value.code == grpc.StatusCode.UNAVAILABLE
                assert failed.value.details.startswith("the Multiplex call failed: ")
            assert mux.failed is not None and len(failures) == 1
            late = _Inbox()  # a stream opened on a failed call fails at once
            mux.open(9, late, _start(9))
            with pytest.raises(_Error):
                await late.read()
        finally:
            await mux.close()


async def test_the_owner_failing_the_call_says_so():
    async with _serving(_Servicer(lambda server, start: None)) as (server, channel):
        mux = _client(channel)
        try:
            inbox = _Inbox()
            mux.open(1, inbox, _start(1))
            mux.fail("no health probe answered")
            with pytest.raises(_Error) as failed:
                await inbox.read()
            assert failed.value.details == (
                "the router ended the Multiplex call: no health probe answered")
        finally:
            await mux.close()


def test_merge_deltas_keeps_order_the_latest_counts_and_the_status() -> None:
    first = TokenDelta("", (1, 2), FinishReason.NONE, 3, 2, 1, index=1)
    second = TokenDelta("", (3,), FinishReason.ERROR, 3, 3, 1, error="bad grammar",
                        error_status="INVALID_ARGUMENT", index=1)
    merged = merge_deltas(first, second)
    assert merged == TokenDelta("", (1, 2, 3), FinishReason.ERROR, 3, 3, 1, error="bad grammar",
                                error_status="INVALID_ARGUMENT", index=1)
    assert merged.status is grpc.StatusCode.INVALID_ARGUMENT
    pb = merged.to_pb(4)
    assert (pb.stream_id, pb.status_code) == (4, grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert TokenDelta.from_pb(pb) == merged


def test_a_delta_crosses_the_wire_as_itself_with_its_status() -> None:
    """The engine core's delta is the wire's type: what the router reads back
    equals what the engine sent (but the request id, named by the stream id,
    and the engine's own scheduling time)."""
    sent = TokenDelta("r1", (5, 6), FinishReason.NONE, 4, 2, 3, index=2, scheduled_at=7.5)
    assert TokenDelta.from_pb(sent.to_pb(9)) == TokenDelta("", (5, 6), FinishReason.NONE, 4, 2, 3,
                                                           index=2)
    failed = TokenDelta("r1", (), FinishReason.ERROR, 4, 2)  # the engine failed it
    read = TokenDelta.from_pb(failed.to_pb(9))
    assert (read.status, read.error, read.finished) == (
        grpc.StatusCode.INTERNAL, "the engine failed the request", True)
    refused = TokenDelta("", (), FinishReason.NONE, 0, 0, error="queue full",
                         error_status="RESOURCE_EXHAUSTED")  # a status-only delta
    pb = refused.to_pb(9)
    assert (pb.finish_reason, pb.status_code) == (0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    assert TokenDelta.from_pb(pb) == refused and not refused.is_empty
