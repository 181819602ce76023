"""The engine's end of one ``Multiplex`` call: an adapter over the stream kit
(:mod:`services.common.mux`) speaking :mod:`services.common.wire.engine_stream`.

The router keeps one such call per engine replica instead of opening a
``Generate`` stream per request, so a request's start costs no new HTTP/2
stream and an engine step costs one message per router, not one per sequence
(the shape of Triton's ``ModelStreamInfer``).

:class:`MultiplexCall` owns the call's open requests (by the caller's
``stream_id``) and its kit server, whose outbox merges updates per stream and
choice (:func:`merge_updates`): each request runs in its own task
(:meth:`EngineService.run_request`, so logs and metrics are the same as on
``Generate``) and puts its deltas into the outbox as :class:`EngineUpdate`
values; the call's writer sends whatever the outbox holds as one
``MultiplexResponse``. The engine core hands a step's deltas to the event loop
in one callback, so every sequence of a step has put its delta before the
writer runs: one message per step. While the
caller reads slowly (HTTP/2 flow control holds the writer), a request's pending
updates merge into one, so the outbox holds at most one update per open
request.

Statuses ride per request (``SequenceUpdate.status_code``): a request that
cannot run (bad input, queue full, draining) or fails ends alone; the call
fails only with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import structlog

from llmesh.v1 import engine_pb2
from services.common import tracing
from services.common.logging import bind_request_id
from services.common.mux import MuxServer, ProtocolViolation
from services.common.sampling import FinishReason, InvalidRequestError
from services.common.wire.engine_stream import (
    EngineStart,
    EngineUpdate,
    Usage,
    merge_updates,
    pack_updates,
    unpack_requests,
)
from services.engine.request_record import RequestFailed, RequestRecord
from services.engine.types import SequenceRequest, TokenDelta

log = structlog.get_logger()

#: Runs one request (``EngineService.run_request``): its deltas, or RequestFailed.
RunRequest = Callable[[SequenceRequest, RequestRecord, Callable[[], str]],
                      AsyncIterator[TokenDelta]]


def update_of(stream_id: int, delta: TokenDelta) -> EngineUpdate:
    """``delta`` as the wire's update of stream ``stream_id``."""
    failed = delta.finish_reason is FinishReason.ERROR
    return EngineUpdate(
        stream_id, delta.token_ids,
        None if delta.finish_reason is FinishReason.NONE else delta.finish_reason,
        Usage(delta.num_prompt_tokens, delta.num_generated_tokens, delta.num_cached_tokens),
        delta.logprobs, delta.prompt_logprobs, delta.index,
        delta.error_code if failed else grpc.StatusCode.OK,
        (delta.error or "the engine failed the request") if failed else "")


class MultiplexCall:
    """The open requests of one ``Multiplex`` call and the tasks running them.

    Args:
      to_request: converts a start's protobuf ``EngineRequest`` to a
        :class:`SequenceRequest` (raises InvalidRequestError naming the field).
      run_request: ``EngineService.run_request``.
      refusal: None while the engine admits requests, else why not (a start
        then ends with UNAVAILABLE and this message).
      cancel_choice: ``EngineBackend.cancel_choice`` (request id, choice index).
    """

    def __init__(self, *, to_request: Callable[[engine_pb2.EngineRequest], SequenceRequest],
                 run_request: RunRequest, refusal: Callable[[], str | None],
                 cancel_choice: Callable[[str, int], bool] = lambda _id, _index: False
                 ) -> None:
        self.server: MuxServer[tuple[int, int], EngineUpdate] = MuxServer(
            merge=merge_updates, pack=pack_updates)
        self.outbox = self.server.outbox
        self._cancel_choice = cancel_choice
        self._to_request = to_request
        self._run_request = run_request
        self._refusal = refusal
        self._open: dict[int, _Open] = {}

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
                self._cancel_choice(entry.request.request_id, choice.index)

    def _status(self, stream_id: int, code: grpc.StatusCode, message: str) -> None:
        """Ends the request (every choice) with ``code`` (its last update)."""
        self.outbox.put((stream_id, 0), EngineUpdate(stream_id, status=code, message=message))

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
        loop = asyncio.get_running_loop()
        entry = _Open(request, RequestRecord(len(request.prompt_token_ids), request.sampling.n,
                                             tracing.context_of(start.traceparent)))
        # The request's id is bound in the task's own context, so its log line
        # has it even when the task is cancelled before it first runs.
        context = contextvars.copy_context()
        context.run(bind_request_id, request.request_id)
        entry.task = loop.create_task(self._run(stream_id, entry), context=context)
        entry.task.add_done_callback(functools.partial(self._ended, stream_id, entry),
                                     context=context)
        if start.timeout_ms:
            entry.timer = loop.call_later(start.timeout_ms / 1e3, self.cancel, stream_id,
                                          "deadline_exceeded")
        entry.timeout_ms = start.timeout_ms
        self._open[stream_id] = entry

    def cancel(self, stream_id: int, cause: str) -> None:
        """Finishes the request at once (``cause`` goes to its log line:
        ``cancel_message``, ``deadline_exceeded``, ``call_dropped``); its last
        update follows (CANCELLED, or DEADLINE_EXCEEDED for a deadline; none
        for a dropped call). Unknown or finished ids are ignored.

        It cancels the request's task, never the backend's request id: a start
        refused as a duplicate id must not cancel the request that owns the id.
        Closing the task's backend stream cancels the sequence if the backend
        admitted it."""
        entry = self._open.get(stream_id)
        if entry is None or entry.record.cancelled_by:
            return
        entry.record.cancelled_by = cause
        assert entry.task is not None
        entry.task.cancel()

    async def _run(self, stream_id: int, entry: _Open) -> None:
        record = entry.record
        deltas = self._run_request(entry.request, record,
                                   lambda: record.cancelled_by or "call_dropped")
        try:
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    self.outbox.put((stream_id, delta.index), update_of(stream_id, delta))
        except RequestFailed as exc:
            self._status(stream_id, exc.code, exc.message)

    def _ended(self, stream_id: int, entry: _Open, task: asyncio.Task[None]) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        if self._open.get(stream_id) is entry:
            del self._open[stream_id]
        if not task.cancelled():
            return
        record = entry.record
        # No last delta came through the task: say how it ended (its log line
        # is written already unless the task never ran).
        record.finish(FinishReason.CANCELLED, record.cancelled_by)
        if record.cancelled_by == "deadline_exceeded":
            self._status(stream_id, grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"timeout_ms ({entry.timeout_ms} ms) passed after "
                         f"{record.num_generated_tokens} generated tokens")
        elif record.cancelled_by == "cancel_message":
            self.outbox.put((stream_id, 0), update_of(stream_id, TokenDelta(
                entry.request.request_id, (), FinishReason.CANCELLED,
                len(entry.request.prompt_token_ids), record.num_generated_tokens,
                record.num_cached_tokens)))

    def cancel_all(self) -> None:
        """Cancels every open request (the call ended). Mutates."""
        for stream_id in list(self._open):
            self.cancel(stream_id, "call_dropped")

    async def wait_all(self) -> None:
        """Waits until every open request's task has ended."""
        while self._open:
            await asyncio.wait([e.task for e in self._open.values() if e.task is not None])


@dataclass(eq=False)
class _Open:
    """One open request of the call."""

    request: SequenceRequest
    record: RequestRecord
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    timeout_ms: int = 0
