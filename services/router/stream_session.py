"""One ``GenerateStream`` call as a state machine over a typed event union.

A session runs one generation at a time on a bidi call. Everything that can
happen to it arrives in one inbox as a :data:`StreamEvent`, and only the
session's own task acts on it (and writes to the call), so no state is shared:

* :class:`ClientSent` / :class:`ClientClosed` / :class:`ClientFailed`: the
  client's next message, its half-close, or the call broke (from a reader task);
* :class:`Produced` / :class:`ProducerFailed`: the running generation's next
  event (the producer waits for its write), or its error (from the producer task);
* :class:`DrainStarted`: the router began draining.

States: *idle* (nothing running), *running* (``current`` set), *closing* (the
client half-closed; the running generation finishes), *done*. Transitions:

=============================  ==========================  ==========================
event                          idle                        running
=============================  ==========================  ==========================
``start``                      running (validated)         FAILED_PRECONDITION
``cancel`` (no id / its id)    ignored                     CANCELLED finals; idle
``cancel`` (another id)        ignored                     ignored
neither start nor cancel       INVALID_ARGUMENT            INVALID_ARGUMENT
unknown field                  INVALID_ARGUMENT            INVALID_ARGUMENT
Produced (this generation)     --                          written; idle after the
                                                           last choice's Finished
Produced / ProducerFailed of   ignored                     ignored
an older generation
ProducerFailed (this one)      --                          its status
ClientClosed                   done                        closing
ClientFailed                   its status                  its status
drain                          UNAVAILABLE                 UNAVAILABLE once idle
nothing for the idle limit     DEADLINE_EXCEEDED           (no limit)
=============================  ==========================  ==========================

A status ends the call: :meth:`StreamSession.run` raises it (a
:class:`GenerationError`, an :class:`InvalidRequestError` or the producer's
own error), and the servicer turns it into the call's status. The shape is
TGI's one-owner queue (``backends/v3/src/queue.rs``): commands in, one task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import structlog

from llmesh.v1 import generation_pb2
from services.common.logging import bind_request_id
from services.common.sampling import FinishReason, InvalidRequestError
from services.router.generation import Delta, Event, Finished, GenerationError, Progress
from services.router.routing import RoutingSession
from services.router.validation import reject_unknown_fields

log = structlog.get_logger()

#: How a draining router ends a ``GenerateStream`` session (UNAVAILABLE).
STREAM_DRAIN_MESSAGE = ("the router is draining (shutting down); reconnect to continue the "
                        "conversation on another instance")


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class ClientSent:
    """The client's next message on the call."""

    message: generation_pb2.GenerateStreamRequest


@dataclass(frozen=True)
class ClientClosed:
    """The client half-closed the call: no more messages."""


@dataclass(frozen=True)
class ClientFailed:
    """Reading the client's messages failed (the call broke)."""

    error: Exception


@dataclass(frozen=True)
class DrainStarted:
    """The router began draining."""


@dataclass(frozen=True)
class Produced:
    """Generation ``number``'s next event; its producer waits for ``written``."""

    number: int
    event: Event
    written: asyncio.Future[None]


@dataclass(frozen=True)
class ProducerFailed:
    """Generation ``number`` failed with ``error``."""

    number: int
    error: Exception


StreamEvent = ClientSent | ClientClosed | ClientFailed | DrainStarted | Produced | ProducerFailed


# ------------------------------------------------------------------ host


@dataclass
class StreamGeneration:
    """What a host gives the session for one started generation."""

    request_id: str
    #: The generation's events (Deltas, one Finished per choice); not started yet.
    events: AsyncIterator[Event]
    #: Choices (``sampling.n``).
    n: int = 1
    #: Live token counts (the usage of a CANCELLED final).
    progress: Progress = field(default_factory=Progress)


class StreamHost(Protocol):
    """What the session needs from the router (and its call)."""

    @property
    def draining(self) -> bool:
        """Whether the router drains."""
        ...

    def open(self, start: generation_pb2.GenerateRequest, request_id: str,
             routing: RoutingSession) -> StreamGeneration:
        """Validates and admits ``start`` (counting a refusal) and returns its
        generation, not yet run.

        Raises:
          GenerationError, InvalidRequestError, AuthError: refused.
        """
        ...

    def count_refused(self, start: generation_pb2.GenerateRequest,
                      code: grpc.StatusCode) -> None:
        """Counts a ``start`` the session refused."""
        ...

    async def write(self, request_id: str, event: Event) -> None:
        """Writes ``event`` of generation ``request_id`` to the call."""
        ...


@dataclass
class _Running:
    """The generation running on the session."""

    number: int
    request_id: str
    task: asyncio.Task[None]
    progress: Progress
    #: choices without their Finished yet; the generation ends with the last
    unfinished: set[int]


# --------------------------------------------------------------- session


class StreamSession:
    """One ``GenerateStream`` call: see the module docstring for its states."""

    def __init__(self, host: StreamHost, stream_id: str, *, idle_timeout_s: float) -> None:
        """Args:
          host: the router's side of the call.
          stream_id: the call's id; the first generation's id unless its
            ``start`` names one (later ones get ``<stream_id>.<number>``).
          idle_timeout_s: with nothing running, how long the session waits
            for a client message (seconds; 0 or less: forever).
        """
        self.host = host
        self.stream_id = stream_id
        self.idle_timeout_s = idle_timeout_s
        self.inbox: asyncio.Queue[StreamEvent] = asyncio.Queue()
        #: The id of the last generation started (the call's status names it).
        self.last_id = stream_id
        self.current: _Running | None = None
        self.started = 0
        self.client_done = False
        #: Later turns go where the earlier ones' KV is.
        self.routing = RoutingSession()

    @property
    def done(self) -> bool:
        """The client half-closed and nothing runs: the call ends OK."""
        return self.client_done and self.current is None

    def drain(self) -> None:
        """Tells the session the router drains (any task may call it)."""
        self.inbox.put_nowait(DrainStarted())

    async def run(self, messages: AsyncIterator[generation_pb2.GenerateStreamRequest]) -> None:
        """Runs the call to its end.

        Raises:
          GenerationError, InvalidRequestError, or a generation's error: the
            status that ends the call (the running generation is cancelled).
        """
        reader = asyncio.create_task(self._read(messages))
        try:
            while not self.done:
                if self.host.draining and self.current is None:
                    log.info("stream_ended_by_drain", generations=self.started)
                    raise GenerationError(grpc.StatusCode.UNAVAILABLE, STREAM_DRAIN_MESSAGE)
                await self.handle(await self._next())
        finally:
            reader.cancel()
            if self.current is not None:
                self.current.task.cancel()

    async def handle(self, event: StreamEvent) -> None:
        """One transition (raises the status that ends the call)."""
        match event:
            case ClientSent(message):
                await self._on_message(message)
            case ClientClosed():
                self.client_done = True
            case ClientFailed(error):
                raise error
            case DrainStarted():
                pass  # checked before the next event
            case Produced(number, item, written):
                try:
                    if self._is_current(number):
                        await self._write(item)
                finally:
                    if not written.done():
                        written.set_result(None)
            case ProducerFailed(number, error):
                if self._is_current(number):
                    raise error

    # ------------------------------------------------------------ steps

    async def _next(self) -> StreamEvent:
        """The next event; DEADLINE_EXCEEDED past the idle limit when idle."""
        limit = self.idle_timeout_s
        if self.current is not None or limit <= 0:
            return await self.inbox.get()
        try:
            async with asyncio.timeout(limit):
                return await self.inbox.get()
        except TimeoutError:
            log.info("stream_idle_limit", idle_seconds=limit)
            raise GenerationError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"session idle limit reached: no generation ran and no message came on this "
                f"stream for {limit:g} s (the router's --stream-idle-timeout); open a new "
                "stream for the next turn") from None

    async def _read(self, messages: AsyncIterator[generation_pb2.GenerateStreamRequest]) -> None:
        try:
            async for message in messages:
                self.inbox.put_nowait(ClientSent(message))
            self.inbox.put_nowait(ClientClosed())
        except Exception as err:  # noqa: BLE001 - handed to the session task
            self.inbox.put_nowait(ClientFailed(err))

    async def _on_message(self, message: generation_pb2.GenerateStreamRequest) -> None:
        action = message.WhichOneof("action")
        try:  # named by their path from the message: `start.sampling`, ...
            reject_unknown_fields(message)
        except InvalidRequestError:
            if action == "start":
                self.host.count_refused(message.start, grpc.StatusCode.INVALID_ARGUMENT)
            raise
        if action == "start":
            self._start(message.start)
        elif action == "cancel":
            await self._cancel(message.cancel.request_id)
        else:
            raise GenerationError(grpc.StatusCode.INVALID_ARGUMENT,
                                  "action: set `start` or `cancel`")

    def _start(self, start: generation_pb2.GenerateRequest) -> None:
        if self.current is not None:
            self.host.count_refused(start, grpc.StatusCode.FAILED_PRECONDITION)
            raise GenerationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"start: generation {self.current.request_id!r} is still running on "
                "this stream; send cancel or wait for its final message first")
        self.started += 1
        number = self.started
        if start.request_id:
            request_id = start.request_id  # the host's validation refuses a bad one
        elif number == 1:
            request_id = self.stream_id
        else:
            request_id = f"{self.stream_id}.{number}"
        generation = self.host.open(start, request_id, self.routing)
        task = asyncio.create_task(self._produce(number, generation))
        self.current = _Running(number, generation.request_id, task, generation.progress,
                                set(range(generation.n)))
        self.last_id = generation.request_id

    async def _produce(self, number: int, generation: StreamGeneration) -> None:
        """Hands generation ``number``'s events to the session, one at a time.

        Each event waits until the session has written it: a client that
        reads slowly then slows this loop, not a queue that grows, and the
        pipeline's slow-reader budget (:mod:`services.router.slow_reader`)
        applies to ``GenerateStream`` exactly as to ``Generate``."""
        bind_request_id(generation.request_id)
        loop = asyncio.get_running_loop()
        try:
            async with contextlib.aclosing(generation.events) as events:
                async for event in events:
                    written = loop.create_future()
                    self.inbox.put_nowait(Produced(number, event, written))
                    await written
        except Exception as err:  # noqa: BLE001 - handed to the session task
            self.inbox.put_nowait(ProducerFailed(number, err))

    async def _cancel(self, request_id: str) -> None:
        current = self.current
        if current is None or request_id not in ("", current.request_id):
            log.info("cancel_ignored", cancel_request_id=request_id)
            return
        self.current = None
        # Its finally blocks close the engine stream. Cancelled again until it
        # ends: a cancel swallowed on the way (Python 3.11's wait_for did) must
        # not leave the producer waiting for a write this session never makes.
        while not current.task.done():
            current.task.cancel()
            await asyncio.wait({current.task}, timeout=0.5)
        for index in sorted(current.unfinished):  # each open choice ends CANCELLED
            final = Finished(FinishReason.CANCELLED, "", current.progress.usage(), index=index)
            await self.host.write(current.request_id, final)

    async def _write(self, event: Event) -> None:
        current = self.current
        assert current is not None and isinstance(event, (Delta, Finished))
        await self.host.write(current.request_id, event)
        if isinstance(event, Finished):
            current.unfinished.discard(event.index)
            if not current.unfinished:
                self.current = None

    def _is_current(self, number: int) -> bool:
        """Whether ``number`` is the running generation (else it is left over
        from a cancelled one)."""
        return self.current is not None and self.current.number == number


__all__ = [
    "STREAM_DRAIN_MESSAGE", "ClientClosed", "ClientFailed", "ClientSent", "DrainStarted",
    "Produced", "ProducerFailed", "StreamEvent", "StreamGeneration", "StreamHost",
    "StreamSession",
]
