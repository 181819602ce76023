"""The engine's end of one ``Multiplex`` call: an adapter over the stream kit
(:mod:`services.common.mux`) speaking :mod:`services.common.wire.engine_stream`.

The router keeps one such call per engine replica instead of opening a
``Generate`` stream per request, so a request's start costs no new HTTP/2
stream and an engine step costs one message per router, not one per sequence
(the shape of Triton's ``ModelStreamInfer``).

:class:`MultiplexCall` owns the call's open requests (by the caller's
``stream_id``) and its kit server, whose outbox merges updates per stream and
choice (:func:`merge_deltas`). Each request is submitted to the backend with
a :class:`~services.engine.request_sink.RequestSink` (so logs and metrics are
the same as on ``Generate``) that puts the engine core's deltas into the
outbox as they are (the wire's :class:`TokenDelta`, turned into protobuf once,
by the writer): no task, no queue and no copy per request. The torch
engine core hands a step's deltas to the event loop in one callback, so every
sequence of a step has put its update before the call's writer runs: one
``MultiplexResponse`` per step. While the caller reads slowly (HTTP/2 flow
control holds the writer), a request's pending updates merge into one, so the
outbox holds at most one update per open request and choice.

Statuses ride per request (``SequenceUpdate.status_code``): a request that
cannot run (bad input, queue full, draining) or fails ends alone; the call
fails only with the engine.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from llmesh.v1 import engine_pb2
from services.common import tracing
from services.common.mux import MuxServer, ProtocolViolation
from services.common.sampling import FinishReason, InvalidRequestError
from services.common.wire.engine_stream import (
    EngineStart,
    TokenDelta,
    merge_deltas,
    pack_updates,
    unpack_requests,
)
from services.engine.request_record import RequestRecord
from services.engine.request_sink import RequestSink
from services.engine.types import SequenceRequest

log = structlog.get_logger()

#: Makes one request's sink (``EngineService.request_sink``) from the request,
#: its record, the taker of its deltas, how it ends with a status, and what to
#: call when it ended.
MakeSink = Callable[..., RequestSink]


class MultiplexCall:
    """The open requests of one ``Multiplex`` call.

    Args:
      to_request: converts a start's protobuf ``EngineRequest`` to a
        :class:`SequenceRequest` (raises InvalidRequestError naming the field).
      request_sink: ``EngineService.request_sink``.
      refusal: None while the engine admits requests, else why not (a start
        then ends with UNAVAILABLE and this message).
      cancel_choice: ``EngineBackend.cancel_choice`` (request id, choice index).
    """

    def __init__(self, *, to_request: Callable[[engine_pb2.EngineRequest], SequenceRequest],
                 request_sink: MakeSink, refusal: Callable[[], str | None],
                 cancel_choice: Callable[[str, int], bool] = lambda _id, _index: False
                 ) -> None:
        self.server: MuxServer[tuple[int, int], TokenDelta] = MuxServer(
            merge=merge_deltas, pack=pack_updates)
        self.outbox = self.server.outbox
        self._cancel_choice = cancel_choice
        self._to_request = to_request
        self._request_sink = request_sink
        self._refusal = refusal
        self._open: dict[int, _Open] = {}
        self._idle = asyncio.Event()  # no request open
        self._idle.set()

    async def handle(self, message: engine_pb2.MultiplexRequest) -> None:
        """Starts and cancels what ``message`` asks. Mutates.

        Raises:
          ProtocolViolation: a start reuses a stream_id still open (its updates
            could not be told apart); the call must end INVALID_ARGUMENT.
        """
        starts, cancels = unpack_requests(message)
        whole = [c.stream_id for c in cancels if c.index is None]
        # Cancels of open requests go first: a start of this message may reuse
        # their request ids (the engine frees an id with its cancel). Then once
        # more after the starts, for a start cancelled in its own message
        # (cancel is idempotent).
        for stream_id in whole:
            self.cancel(stream_id, "cancel_message")
        for start in starts:
            if start.stream_id in self._open:
                raise ProtocolViolation(f"starts: stream_id {start.stream_id} is still open "
                                        "on this call; use a new id for each request")
            self._start(start)
        for stream_id in whole:
            self.cancel(stream_id, "cancel_message")
        for choice in cancels:
            entry = self._open.get(choice.stream_id)
            if choice.index is not None and entry is not None:
                self._cancel_choice(entry.sink.request.request_id, choice.index)

    def _status(self, stream_id: int, code: grpc.StatusCode, message: str) -> None:
        """Ends the request (every choice) with ``code`` (its last update: a
        status-only delta)."""
        self.outbox.put((stream_id, 0), TokenDelta("", (), FinishReason.NONE, 0, 0,
                                                   error=message, error_status=code.name))

    def _put(self, stream_id: int, delta: TokenDelta) -> None:
        self.outbox.put((stream_id, delta.index), delta)

    def _start(self, start: EngineStart) -> None:
        stream_id = start.stream_id
        refused = self._refusal()
        if refused is not None:
            self._status(stream_id, grpc.StatusCode.UNAVAILABLE, refused)
            return
        try:
            request = self._to_request(start.request)
        except InvalidRequestError as exc:
            log.info("request_rejected", request_id=start.request.request_id, field=exc.field,
                     code=exc.code.name)
            self._status(stream_id, exc.code, str(exc))
            return
        record = RequestRecord(len(request.prompt_token_ids), request.sampling.n,
                               tracing.context_of(start.traceparent))
        entry = _Open(self._request_sink(
            request, record, deliver=functools.partial(self._put, stream_id),
            fail=functools.partial(self._status, stream_id),
            on_end=functools.partial(self._ended, stream_id)), start.timeout_ms)
        self._open[stream_id] = entry  # before the submit: a refusal ends it at once
        self._idle.clear()
        entry.sink.submit()
        if start.timeout_ms and not entry.sink.ended:
            entry.timer = asyncio.get_running_loop().call_later(
                start.timeout_ms / 1e3, self.cancel, stream_id, "deadline_exceeded")

    def cancel(self, stream_id: int, cause: str) -> None:
        """Finishes the request at once (``cause`` goes to its log line:
        ``cancel_message``, ``deadline_exceeded``, ``call_dropped``); its last
        update follows (CANCELLED, or DEADLINE_EXCEEDED for a deadline; none
        for a dropped call). Unknown or finished ids are ignored.

        It cancels the request's own submission, never the backend's request
        id: a start refused as a duplicate id must not cancel the request that
        owns the id."""
        entry = self._open.get(stream_id)
        if entry is None:
            return
        sink = entry.sink
        sink.record.cancelled_by = cause
        if not sink.close(cause):
            return
        if cause == "deadline_exceeded":
            self._status(stream_id, grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"timeout_ms ({entry.timeout_ms} ms) passed after "
                         f"{sink.record.num_generated_tokens} generated tokens")
        elif cause == "cancel_message":
            record, request = sink.record, sink.request
            self._put(stream_id, TokenDelta(
                request.request_id, (), FinishReason.CANCELLED, len(request.prompt_token_ids),
                record.num_generated_tokens, record.num_cached_tokens))

    def _ended(self, stream_id: int) -> None:
        """The request of ``stream_id`` ended (its sink's ``on_end``)."""
        entry = self._open.pop(stream_id)
        if entry.timer is not None:
            entry.timer.cancel()
        if not self._open:
            self._idle.set()

    def cancel_all(self) -> None:
        """Cancels every open request (the call ended). Mutates."""
        for stream_id in list(self._open):
            self.cancel(stream_id, "call_dropped")

    async def wait_all(self) -> None:
        """Waits until every open request has ended."""
        await self._idle.wait()


@dataclass(eq=False)
class _Open:
    """One open request of the call: its sink and deadline."""

    sink: RequestSink
    timeout_ms: int = 0
    timer: asyncio.TimerHandle | None = None
