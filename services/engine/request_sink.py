"""One request's sink on the engine's side of a transport (:class:`RequestSink`).

Both request paths of :mod:`services.engine.service` (``Multiplex``, and the
deprecated ``Generate``) register one with the backend
(:meth:`EngineBackend.submit <services.engine.backend.EngineBackend.submit>`):
it counts each delta as the engine delivers it (metrics, the request's record
and its one log line, its trace spans) and hands it on to the transport (the
``Multiplex`` outbox, or the ``Generate`` call's
:class:`~services.engine.delta_stream.DeltaStream`), with no task or queue of
its own. However the request ends (its last delta, a refusal, a failure, or
:meth:`RequestSink.close` for a cancel, a deadline or a dropped call), the
sink ends once: later deliveries are dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from services.common.sampling import FinishReason, InvalidRequestError
from services.engine.backend import EngineBackend, EngineError, Submission
from services.engine.metrics import EngineMetrics
from services.engine.request_record import RequestRecord
from services.engine.types import SequenceRequest, TokenDelta

log = structlog.get_logger()


class RequestSink:
    """One admitted request's :class:`~services.engine.backend.DeltaSink`.

    Args:
      backend: the backend it is submitted to (:meth:`submit`).
      request: the request.
      record: its record (counts, log line, spans).
      metrics: where its deltas are counted.
      replica_id: this engine's id (its spans).
      deliver: the transport's taker of its deltas.
      fail: how the transport ends the request with a status (code, message).
      on_end: called once when the request ended, however.
    """

    __slots__ = ("_backend", "_deliver", "_fail", "_metrics", "_on_end", "_replica_id",
                 "_submission", "ended", "loop", "record", "request")

    def __init__(self, backend: EngineBackend, request: SequenceRequest, record: RequestRecord,
                 metrics: EngineMetrics, replica_id: str, *, deliver: Callable[[TokenDelta], None],
                 fail: Callable[[grpc.StatusCode, str], None],
                 on_end: Callable[[], None] | None = None) -> None:
        self._backend = backend
        self.request = request
        self.record = record
        self.loop = asyncio.get_running_loop()
        self._metrics = metrics
        self._replica_id = replica_id
        self._deliver = deliver
        self._fail = fail
        self._on_end = on_end
        self._submission: Submission | None = None
        #: Nothing more is delivered.
        self.ended = False

    def submit(self) -> None:
        """Submits the request to the backend with this sink; a refusal ends it
        at once (:meth:`fail`). Mutates."""
        try:
            self._submission = self._backend.submit(self.request, self)
        except Exception as exc:  # noqa: BLE001 - refused (or a bug): this request's status
            self.fail(exc)

    def deliver(self, delta: TokenDelta) -> None:
        """Counts ``delta`` and hands it on; after the request's last delta the
        request ends. Dropped once ended. Mutates."""
        if self.ended:
            return
        record = self.record
        first = record.num_deltas == 0
        last = record.seen(delta)
        if first and record.trace_parent is not None:
            record.first_delta(delta)
        self._metrics.observe_delta(delta, first, last)
        if last:
            with structlog.contextvars.bound_contextvars(request_id=self.request.request_id):
                record.finish(delta.finish_reason, record.cancelled_by, delta.error)
        self._deliver(delta)
        if last:
            self._end()

    def fail(self, error: Exception) -> None:
        """Ends the request with ``error``'s status: a refusal's own
        (``request_rejected`` is logged), INTERNAL for anything else (logged,
        and its ``request_finished`` line says error). Mutates."""
        if self.ended:
            return
        record = self.record
        with structlog.contextvars.bound_contextvars(request_id=self.request.request_id):
            if isinstance(error, InvalidRequestError | EngineError):
                code, message = error.code, str(error)
                record.rejected(code, message)  # refused: never admitted
            else:
                log.error("generate_failed", error=repr(error), exc_info=error)
                code = grpc.StatusCode.INTERNAL
                message = record.error = f"{type(error).__name__}: {error}"
                if record.finish(FinishReason.ERROR, record.cancelled_by):
                    self._metrics.observe_unseen_end(FinishReason.ERROR)
        self._fail(code, message)
        self._end()

    def close(self, cause: str) -> bool:
        """Ends the request before its last delta: cancels it in the backend and
        writes its line as cancelled by ``cause`` (``cancel_message``,
        ``deadline_exceeded``, ``call_dropped``). Mutates.

        Returns:
          False when it had ended already (nothing done).
        """
        if self.ended:
            return False
        if self._submission is not None:
            self._submission.cancel()
        with structlog.contextvars.bound_contextvars(request_id=self.request.request_id):
            if self.record.finish(FinishReason.CANCELLED, cause):
                self._metrics.observe_unseen_end(FinishReason.CANCELLED)
        self._end()
        return True

    def _end(self) -> None:
        self.ended = True
        self.record.record_spans(self.request.request_id, self._replica_id)
        if self._on_end is not None:
            self._on_end()
