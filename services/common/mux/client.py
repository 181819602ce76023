"""The caller's end of a multiplexed bidi call (:class:`MuxClient`).

One call carries many streams, each named by a caller-chosen stream id that
every update of the stream carries. What the caller sends (starts, cancels)
is queued and written by one writer task: each wakeup writes everything
queued since the last, packed into as few messages as the adapter's ``pack``
makes. A caller whose item must leave now (a request's start, on the first
token's path) awaits :meth:`MuxClient.flush` after queueing it: the writer
runs before the caller goes on, instead of at the caller's next wait. One
reader task hands each incoming update to its stream's :class:`Receiver`;
updates for ids no longer open (a stream closed early) are dropped.

Errors: when the call breaks (the peer ends it, a read or write fails, or the
owner calls :meth:`MuxClient.fail`), every open stream fails with the error
``make_error(UNAVAILABLE, why)`` builds and the call is cancelled; a caller
opens a new client for the next request (:attr:`MuxClient.failed` says when).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import grpc
import structlog

log = structlog.get_logger()

Item = TypeVar("Item")  # what the caller queues (a start, a cancel)
Update = TypeVar("Update")  # one stream's update, as the reader hands it on
Update_contra = TypeVar("Update_contra", contravariant=True)


class Receiver(Protocol[Update_contra]):
    """One open stream's receiving end."""

    def deliver(self, update: Update_contra) -> bool:
        """Takes one update; True when it is the stream's last."""

    def fail(self, error: BaseException) -> None:
        """The call broke: the stream ends with ``error``."""


class MuxClient(Generic[Item, Update]):
    """One long-lived bidi call and the streams open on it.

    Args:
      call: the open stream-stream call (``stub.Method()``): ``write``,
        ``read``, ``cancel``.
      pack: the queued items (at least one) as the messages to write, in order.
      unpack: one received message as ``(stream_id, update)`` pairs.
      make_error: the exception a stream fails with, from a status code and
        its details.
      service, target: the peer's name and address (log lines, messages).
      owner: who holds this end, for the messages (``"router"``).
      on_failed: called with the reason when the call breaks (not when the
        owner closes it).
      expected: whether a break for this reason is one the owner expects and
        logs itself (e.g. a draining peer's refusal whose streams the owner
        sends again): then the kit logs no ``mux_call_failed`` warning for it.
        Called once, before ``on_failed``; must not change the owner's state.
    """

    def __init__(self, call: Any, *, pack: Callable[[list[Item]], Iterable[Any]],
                 unpack: Callable[[Any], Iterable[tuple[int, Update]]],
                 make_error: Callable[[grpc.StatusCode, str], BaseException],
                 service: str, target: str, owner: str = "router",
                 on_failed: Callable[[str], None] | None = None,
                 expected: Callable[[str], bool] | None = None) -> None:
        self._call = call
        self._pack = pack
        self._unpack = unpack
        self._make_error = make_error
        self._service = service
        self.target = target
        self._owner = owner
        self._on_failed = on_failed
        self._expected = expected
        self._streams: dict[int, Receiver[Update]] = {}
        self._queued: list[Item] = []
        self._wake = asyncio.Event()
        self._closing = False
        #: Set once the call broke: every stream on it failed with this.
        self.failed: BaseException | None = None
        # A context of their own: the tasks serve every stream, so they must not
        # carry the request id of the one that happened to open the call.
        self._reader = asyncio.create_task(self._read(), context=contextvars.Context())
        self._writer = asyncio.create_task(self._write(), context=contextvars.Context())

    def open(self, stream_id: int, receiver: Receiver[Update], start: Item) -> None:
        """Registers ``receiver`` for ``stream_id`` and queues ``start``.
        After the call failed the receiver fails at once."""
        if self.failed is not None:
            receiver.fail(self.failed)
            return
        self._streams[stream_id] = receiver
        self.send(start)

    def send(self, item: Item) -> None:
        """Queues ``item`` for the writer (dropped once the call failed)."""
        if self.failed is None:
            self._queued.append(item)
            self._wake.set()

    async def flush(self) -> None:
        """Lets the writer hand what is queued to the call before the caller
        goes on (at one stream a start then leaves ~0.3 ms sooner than at the
        caller's next wait, e.g. the response headers it sends next).

        Yields to the event loop once when something is queued: the writer,
        woken when the first of it was queued, runs first and writes all of it
        in one batch. While an earlier write is still under way the items stay
        queued for the writer's next batch, in order. Never raises; a failed
        call dropped the items."""
        if self._queued and self.failed is None:
            await asyncio.sleep(0)

    @property
    def queued(self) -> int:
        """Items queued and not yet handed to the call."""
        return len(self._queued)

    def forget(self, stream_id: int) -> None:
        """Drops ``stream_id``'s receiver: its later updates are ignored."""
        self._streams.pop(stream_id, None)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queued:
                    queued, self._queued = self._queued, []
                    for message in self._pack(queued):
                        await self._call.write(message)
        except grpc.aio.AioRpcError as err:
            self._fail_all(f"writing to it failed: {err.code().name}: {err.details()}")
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            self._fail_all(f"writing to it failed: {type(err).__name__}: {err}")

    async def _read(self) -> None:
        why = f"the {self._service} ended the Multiplex call"
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                for stream_id, update in self._unpack(message):
                    receiver = self._streams.get(stream_id)
                    if receiver is not None and receiver.deliver(update):
                        del self._streams[stream_id]
                # The streams this message woke run first (a token goes on to
                # its client), then the next read is posted.
                await asyncio.sleep(0)
        except grpc.aio.AioRpcError as err:
            why = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            self._fail_all(f"the {self._owner} closed the call")
            raise
        self._fail_all(why)

    def _fail_all(self, why: str, *, by_owner: bool = False) -> None:
        if self.failed is None:
            what = (f"the {self._owner} ended the Multiplex call" if by_owner
                    else "the Multiplex call failed")
            self.failed = self._make_error(grpc.StatusCode.UNAVAILABLE, f"{what}: {why}")
            if not self._closing:
                if self._streams and not (self._expected is not None and self._expected(why)):
                    log.warning("mux_call_failed", service=self._service, target=self.target,
                                why=why, open_streams=len(self._streams))
                if self._on_failed is not None:
                    self._on_failed(why)
        streams, self._streams = self._streams, {}
        for receiver in streams.values():
            receiver.fail(self.failed)
        self._queued.clear()
        self._call.cancel()
        current = asyncio.current_task()
        for task in (self._reader, self._writer):
            if task is not current:
                task.cancel()

    def fail(self, why: str) -> None:
        """Ends the call and every stream on it with UNAVAILABLE (the owner
        gave up on the peer)."""
        if self.failed is None:
            self._fail_all(why, by_owner=True)

    async def close(self) -> None:
        """Cancels the call and its tasks (streams still open fail)."""
        self._closing = True
        self._call.cancel()
        for task in (self._reader, self._writer):
            task.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)
