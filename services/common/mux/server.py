"""The handler's end of a multiplexed bidi call (:class:`MuxServer`).

The adapter's ``handle`` gets each of the caller's messages in order (it starts
and cancels streams and puts their updates into :attr:`MuxServer.outbox`); the
handler's response iterator writes whatever the outbox holds at each wakeup,
packed by the adapter's ``pack`` (one message per wakeup where the wire type
batches, as the engine's ``MultiplexResponse`` does). While the caller reads
slowly, a stream's pending updates merge in the outbox (the wire type's merge
function), so it holds at most one update per key.

Statuses: a message that breaks the protocol (``handle`` raises
:class:`ProtocolViolation`) ends the call with the violation's code once what
is queued has been written; a bug in ``handle`` ends it INTERNAL. Per-stream
statuses are the adapter's, carried in its updates.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

import grpc
import structlog

from services.common.mux.mailbox import Mailbox, Merge

log = structlog.get_logger()

K = TypeVar("K")
U = TypeVar("U")


class ProtocolViolation(Exception):
    """A caller's message breaks the call's protocol (e.g. it reuses a stream
    id still open): the call ends with ``code`` (INVALID_ARGUMENT unless said)."""

    def __init__(self, message: str,
                 code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


class MuxServer(Generic[K, U]):
    """One call's outbox and the loop that serves it.

    Args:
      merge: the wire type's merge function (for a key's pending updates).
      pack: the pending updates (at least one, in arrival order) as the
        messages to write.
    """

    def __init__(self, *, merge: Merge[U],
                 pack: Callable[[dict[K, U]], Iterable[Any]]) -> None:
        self.outbox: Mailbox[K, U] = Mailbox(merge)
        self._pack = pack
        self._violation: ProtocolViolation | None = None

    async def serve(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, *,
                    handle: Callable[[Any], Awaitable[None]],
                    finish: Callable[[], Awaitable[None]]) -> AsyncIterator[Any]:
        """The handler's response messages: feeds ``requests`` to ``handle``;
        once the caller half-closes, awaits ``finish()`` (the adapter waits for
        its open streams), then ends after writing what is queued. The adapter
        may also end it early with ``outbox.close()``.

        Raises (through ``context.abort``): the violation's status, or INTERNAL
        when ``handle`` failed unexpectedly.
        """
        reader = asyncio.create_task(self._read(requests, handle, finish))
        try:
            while await self.outbox.wait():
                for message in self._pack(self.outbox.take_all()):
                    yield message
            if self._violation is not None:
                await context.abort(self._violation.code, str(self._violation))
            failure = reader.exception() if reader.done() and not reader.cancelled() else None
            if failure is not None:  # a bug: the call must not end OK with requests unread
                log.error("mux_handler_failed", error=repr(failure))
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"internal error: {type(failure).__name__}: {failure}")
        finally:
            reader.cancel()

    async def _read(self, requests: AsyncIterator[Any], handle: Callable[[Any], Awaitable[None]],
                    finish: Callable[[], Awaitable[None]]) -> None:
        messages = aiter(requests)
        try:
            while True:
                try:
                    message = await anext(messages)
                except StopAsyncIteration:
                    break
                except (grpc.RpcError, RuntimeError):  # the call ended under us
                    return
                await handle(message)
            await finish()
        except ProtocolViolation as violation:
            self._violation = violation
        finally:
            self.outbox.close()
