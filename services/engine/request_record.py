"""What the engine knows of one request for its log line, and how a request
that cannot finish normally ends (:class:`RequestFailed`).

Used by both request paths of :mod:`services.engine.service` (``Generate``)
and :mod:`services.engine.multiplex` (``Multiplex``), so each admitted request
writes exactly one ``request_finished`` line (a refused one
``request_rejected``) whichever RPC carried it.
"""

from __future__ import annotations

import time

import grpc
import structlog

from services.common import tracing
from services.common.sampling import FinishReason
from services.engine.types import TokenDelta

log = structlog.get_logger()


class RequestFailed(Exception):
    """A request ended with an error status instead of a finish reason.

    Attributes:
      code: the gRPC status for the caller.
      message: what went wrong, for the caller.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestRecord:
    """What one Generate call knows of its request, for its one log line.

    Attributes:
      num_prompt_tokens: the prompt's length.
      num_generated_tokens, num_cached_tokens: the counts of the last delta read
        (for a call that ended before its last delta: the tokens streamed on it);
        with ``sampling.n`` > 1, generated tokens of all choices together.
      choices_left: choices (``sampling.n``) whose last delta was not read yet.
      num_deltas: deltas read.
      cancelled_by: what asked the engine to cancel (``cancel_message``,
        ``invalid_message``, ``call_dropped``, ``deadline_exceeded``; "" if nothing).
      error: why the request failed ("" if it did not).
      done: the line is written (or the request was refused).
      reason: how it ended, as its line says (NONE until then).
      trace_parent: the caller's span when the request is traced (None: not
        traced; then nothing below is recorded).
      received_at, scheduled_at, first_token_at: when the engine took the
        request, first scheduled it and delivered its first token
        (``time.monotonic()`` seconds; 0.0 unknown): its spans' times.
    """

    __slots__ = ("num_prompt_tokens", "num_generated_tokens", "num_cached_tokens",
                 "num_deltas", "cancelled_by", "error", "done", "choices_left", "_generated",
                 "trace_parent", "received_at", "scheduled_at", "first_token_at", "reason")

    def __init__(self, num_prompt_tokens: int, n: int = 1,
                 trace_parent: tracing.Context | None = None) -> None:
        self.trace_parent = trace_parent
        self.received_at = time.monotonic() if trace_parent is not None else 0.0
        self.scheduled_at = self.first_token_at = 0.0
        self.reason = FinishReason.NONE
        self.num_prompt_tokens = num_prompt_tokens
        self.choices_left = n
        self._generated: dict[int, int] = {}
        self.num_generated_tokens = self.num_cached_tokens = self.num_deltas = 0
        self.cancelled_by = self.error = ""
        self.done = False

    def seen(self, delta: TokenDelta) -> bool:
        """Takes the counts of ``delta``, the latest read. Mutates.

        Returns:
          True when it is the request's last delta (its last choice's last).
        """
        self._generated[delta.index] = delta.num_generated_tokens
        self.num_generated_tokens = sum(self._generated.values())
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_deltas += 1
        self.choices_left -= delta.finished
        return delta.finished and not self.choices_left

    def first_delta(self, delta: TokenDelta) -> None:
        """Notes the request's first delta (its first token) for its spans. Mutates."""
        self.first_token_at = time.monotonic()
        self.scheduled_at = delta.scheduled_at

    def record_spans(self, request_id: str, replica_id: str) -> None:
        """The request's spans, made once it ended, from its timestamps (vLLM's
        way: no live span per step): ``llmesh.engine.generate`` (receipt to
        now) under the caller's span, with ``llmesh.engine.queue`` (receipt to
        first scheduled), ``llmesh.engine.prefill`` (to the first token) and
        ``llmesh.engine.decode`` (to now). Nothing when not traced."""
        if self.trace_parent is None:
            return
        now = time.monotonic()
        span = tracing.start_span("llmesh.engine.generate", self.trace_parent,
                                  start=self.received_at, attributes={
                                      tracing.REQUEST_ID: request_id,
                                      tracing.REPLICA: replica_id})
        first = self.first_token_at or None
        scheduled = self.scheduled_at or None
        tracing.record_span("llmesh.engine.queue", span, self.received_at, scheduled)
        tracing.record_span("llmesh.engine.prefill", span, scheduled, first)
        tracing.record_span("llmesh.engine.decode", span, first, now)
        tracing.end_span(span, end=now, error=self.error, attributes={
            tracing.USAGE_INPUT_TOKENS: self.num_prompt_tokens,
            tracing.USAGE_OUTPUT_TOKENS: self.num_generated_tokens,
            tracing.CACHED_TOKENS: self.num_cached_tokens,
            "gen_ai.response.finish_reasons": (self.reason.name.lower(),)})

    def rejected(self, code: grpc.StatusCode, message: str) -> None:
        """Logs ``request_rejected`` for a request the backend refused (queue
        full, duplicate id, ...); no ``request_finished`` line follows. Mutates."""
        self.done = True
        log.info("request_rejected", code=code.name, error=message)

    def finish(self, reason: FinishReason, cancelled_by: str = "", error: str = "") -> bool:
        """Writes the ``request_finished`` line, unless written already.

        Returns:
          True if it wrote it now.
        """
        if self.done:
            return False
        self.done = True
        self.reason = reason
        fields: dict[str, object] = {}
        if reason is FinishReason.CANCELLED and cancelled_by:
            fields["cancelled_by"] = cancelled_by
        if reason is FinishReason.ERROR:
            fields["error"] = error or self.error or "the engine failed"
        log.info("request_finished", outcome=reason.name.lower(), finish_reason=reason.name,
                 prompt_tokens=self.num_prompt_tokens,
                 completion_tokens=self.num_generated_tokens,
                 cached_prompt_tokens=self.num_cached_tokens, **fields)
        return True
