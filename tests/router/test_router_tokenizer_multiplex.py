"""The router's Multiplex call to the tokenizer when it breaks while a request
is being written: the request ends UNAVAILABLE, never with a KeyError from the
table of waiting requests the reader has already emptied (a CI failure)."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest
from llmesh.v1 import tokenizer_pb2

from services.router.clients import UpstreamError, _TokenizerMultiplex


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
        multiplex = _TokenizerMultiplex(_Stub(), "127.0.0.1:1")
        try:
            with pytest.raises(UpstreamError) as failed:
                await multiplex.ask(tokenizer_pb2.TokenizerServiceMultiplexRequest(
                    request_id="r"), timeout=5)
            return failed.value
        finally:
            await multiplex.close()
            gc.collect()  # an exception no one retrieved is reported when its future goes

    err = asyncio.run(scenario())
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "the tokenizer ended the Multiplex call" in err.details
    assert not unhandled, unhandled
