"""The router's Multiplex call to the tokenizer when it breaks while a request
is being written: the request ends UNAVAILABLE, never with a KeyError from the
table of waiting requests the reader has already emptied (a CI failure)."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest
from llmesh.v1 import tokenizer_pb2

from services.router.clients import UpstreamError, ask, tokenizer_multiplex


class _BreakingCall:
    """A Multiplex call whose stream ends (EOF) while a write is in flight; the
    write then fails as grpc.aio does on a finished call."""

    def __init__(self) -> None:
        self.writing = asyncio.Event()
        self.ended = asyncio.Event()

    async def write(self, message) -> None:
        self.writing.set()
        await self.ended.wait()
        raise asyncio.InvalidStateError("RPC already finished.")

    async def read(self):
        await self.writing.wait()
        self.ended.set()
        return grpc.aio.EOF

    def cancel(self) -> bool:
        return True


class _Stub:
    def __init__(self) -> None:
        self.call = _BreakingCall()

    def Multiplex(self) -> _BreakingCall:  # noqa: N802 (the gRPC method's name)
        return self.call


def test_a_write_that_fails_after_the_reader_failed_the_call_raises_unavailable() -> None:
    unhandled: list[dict] = []

    async def scenario() -> UpstreamError:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        multiplex = tokenizer_multiplex(_Stub().Multiplex(), "127.0.0.1:1")
        try:
            with pytest.raises(UpstreamError) as failed:
                await ask(multiplex, 1, tokenizer_pb2.TokenizerServiceMultiplexRequest(
                    request_id="r"), timeout=5)
            return failed.value
        finally:
            await multiplex.close()
            gc.collect()  # an exception no one retrieved is reported when its future goes

    err = asyncio.run(scenario())
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "the tokenizer ended the Multiplex call" in err.details
    assert not unhandled, unhandled


class _IdleCall:
    """A Multiplex call that takes writes and never answers by itself."""

    async def write(self, message) -> None:
        return None

    async def read(self):
        await asyncio.Event().wait()

    def cancel(self) -> bool:
        return True


class _IdleStub:
    def Multiplex(self) -> _IdleCall:  # noqa: N802 (the gRPC method's name)
        return _IdleCall()


def test_a_cancel_that_lands_with_the_answer_is_not_swallowed() -> None:
    """The answer arrives in the same loop turn as the caller's cancel: the
    caller still ends cancelled. (Python 3.11's ``asyncio.wait_for`` returned
    the answer instead; a ``GenerateStream`` turn cancelled right after its
    start then ran on, and the stream hung: found by the fuzz soak.)"""

    async def scenario() -> asyncio.Task:
        multiplex = tokenizer_multiplex(_IdleStub().Multiplex(), "127.0.0.1:1")
        try:
            task = asyncio.create_task(ask(
                multiplex, 1, tokenizer_pb2.TokenizerServiceMultiplexRequest(request_id="r"),
                timeout=5))
            while not multiplex._streams:  # the request is open; its answer is awaited
                await asyncio.sleep(0)
            (answer,) = multiplex._streams.values()
            answer.deliver(tokenizer_pb2.TokenizerServiceMultiplexResponse(call_id=1))
            task.cancel()  # same turn: nothing ran in between
            await asyncio.wait({task})
            return task
        finally:
            await multiplex.close()

    assert asyncio.run(scenario()).cancelled()
