"""The messages of the engine's ``Multiplex`` call, as both ends use them.

The router (:mod:`services.router.engine_client`) sends :class:`EngineStart`
and :class:`StreamCancel`; the engine (:mod:`services.engine.multiplex`)
answers with :class:`TokenDelta` values, the engine core's own per-step
result (no copy per token on the way), merged per stream and choice with
:func:`merge_deltas` while the other end reads slowly (in the engine's outbox
and in the router's per-request inbox, both :class:`services.common.mux.Mailbox`),
and read by the router as the same type.
The ``pack_*``/``unpack_*`` functions are the two edges where protobuf is made
and read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import grpc

from llmesh.v1 import common_pb2, engine_pb2
from services.common.grpc_util import status_code_of
from services.common.logprobs import PositionLogprobs, logprobs_from_pb, logprobs_to_pb
from services.common.sampling import FinishReason

#: About the most bytes of starts the router puts in one ``MultiplexRequest``.
MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request (tokens, not characters)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    #: Chat history compaction (set by the router: :mod:`services.router.history`).
    history_turns_summarized: int = 0
    history_tokens_saved: int = 0

    def to_pb(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.prompt_tokens,
                                completion_tokens=self.completion_tokens,
                                cached_prompt_tokens=self.cached_prompt_tokens,
                                history_turns_summarized=self.history_turns_summarized,
                                history_tokens_saved=self.history_tokens_saved)

    @classmethod
    def from_pb(cls, pb: common_pb2.Usage) -> Usage:
        return cls(pb.prompt_tokens, pb.completion_tokens, pb.cached_prompt_tokens,
                   pb.history_turns_summarized, pb.history_tokens_saved)


@dataclass(frozen=True, slots=True)
class EngineStart:
    """A request to start on the call.

    Attributes:
      stream_id: the caller's id for it, unique among the call's open streams.
      request: the engine request (validated by the engine at its edge,
        ``EngineService.to_engine_request``).
      timeout_ms: milliseconds it may take from its arrival; 0: no deadline.
      traceparent: the caller's span as a W3C ``traceparent``; "" when not
        traced (:mod:`services.common.tracing`).
    """

    stream_id: int
    request: engine_pb2.EngineRequest
    timeout_ms: int = 0
    traceparent: str = ""

    def to_pb(self) -> engine_pb2.MultiplexStart:
        return engine_pb2.MultiplexStart(stream_id=self.stream_id, request=self.request,
                                         timeout_ms=self.timeout_ms,
                                         traceparent=self.traceparent)

    @classmethod
    def from_pb(cls, pb: engine_pb2.MultiplexStart) -> EngineStart:
        return cls(pb.stream_id, pb.request, pb.timeout_ms, pb.traceparent)

    @property
    def wire_bytes(self) -> int:
        """About its size on the wire (bytes), without serializing it."""
        return 64 + 5 * len(self.request.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class StreamCancel:
    """Finish a stream at once (``index`` None), or one choice of it."""

    stream_id: int
    index: int | None = None


@dataclass(frozen=True)
class TokenDelta:
    """What one choice of a request did since its previous delta: the engine
    core's per-step result, delivered as it is to the transport (the
    ``Multiplex`` outbox, or the deprecated ``Generate`` call), sent as one
    ``SequenceUpdate`` and read back as the same type by the router.

    The last delta of a choice has ``finish_reason != FinishReason.NONE``;
    every delta carries the running token counts.

    Attributes:
      request_id: the request this delta belongs to ("" as read from the
        wire: there the stream id names the request).
      token_ids: new token ids (may be empty on the last delta, e.g. after a cancel).
        A final stop token (EOS or a stop token id) is included; the router
        does not render its text.
      finish_reason: ``FinishReason.NONE`` until the last delta.
      num_prompt_tokens: tokens in the prompt.
      num_generated_tokens: tokens generated so far, including a final stop token.
      num_cached_tokens: prompt tokens whose KV cache was reused.
      error: why the request failed (with ``FinishReason.ERROR``, or on a
        status-only delta: see ``error_status``).
      error_status: the gRPC status name the request ends with when the
        failure is the request's own (e.g. ``INVALID_ARGUMENT``: its output
        constraint failed mid-generation), "" otherwise (INTERNAL with
        ``FinishReason.ERROR``: the engine failed). Set with
        ``FinishReason.NONE`` it is a status-only delta: the request ended
        before it ran (refused, or its deadline passed), nothing follows.
      logprobs: with ``sampling.logprobs``: one entry per id in ``token_ids``.
      prompt_logprobs: with ``sampling.prompt_logprobs``: one entry per prompt
        token after the first, on the first delta of choice 0 only.
      index: the choice (0..n-1) of a request with ``sampling.n`` > 1; each
        choice ends with its own last delta, and the token counts are its own
        (``num_generated_tokens`` of that choice).
      scheduled_at: when the sequence was first scheduled (``time.monotonic()``
        seconds; 0.0 before, from a backend that does not say, or as read
        from the wire): the end of its engine queue time and the start of
        its prefill (the engine's trace spans). Not sent.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int = 0
    error: str = ""
    error_status: str = ""
    logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    index: int = 0
    scheduled_at: float = 0.0

    @property
    def finished(self) -> bool:
        """True on the last delta of a choice."""
        return self.finish_reason is not FinishReason.NONE

    @property
    def status(self) -> grpc.StatusCode:
        """The status the request ends with: ``error_status``'s; INTERNAL for a
        ``FinishReason.ERROR`` without one; OK otherwise."""
        if self.error_status:
            return grpc.StatusCode[self.error_status]
        return (grpc.StatusCode.INTERNAL if self.finish_reason is FinishReason.ERROR
                else grpc.StatusCode.OK)

    @property
    def usage(self) -> Usage:
        """The running token counts."""
        return Usage(self.num_prompt_tokens, self.num_generated_tokens, self.num_cached_tokens)

    @property
    def is_empty(self) -> bool:
        """Carries no ids, logprobs, finish or status (running counts only)."""
        return not (self.token_ids or self.finished or self.logprobs or self.prompt_logprobs
                    or self.error_status)

    def to_pb(self, stream_id: int) -> engine_pb2.SequenceUpdate:
        """The wire's ``SequenceUpdate`` of stream ``stream_id``."""
        status = self.status
        return engine_pb2.SequenceUpdate(
            stream_id=stream_id, index=self.index, token_ids=self.token_ids,
            logprobs=logprobs_to_pb(self.logprobs),
            prompt_logprobs=logprobs_to_pb(self.prompt_logprobs),
            finish_reason=int(self.finish_reason), usage=self.usage.to_pb(),
            status_code=status.value[0],
            status_message=(self.error or "the engine failed the request")
            if status is not grpc.StatusCode.OK else "")

    @classmethod
    def from_pb(cls, pb: engine_pb2.SequenceUpdate) -> TokenDelta:
        try:
            finish = FinishReason(pb.finish_reason)
        except ValueError:  # a newer engine's reason: it ended, we cannot say why
            finish = FinishReason.ERROR
        status = status_code_of(pb.status_code)
        return cls("", tuple(pb.token_ids), finish, pb.usage.prompt_tokens,
                   pb.usage.completion_tokens, pb.usage.cached_prompt_tokens,
                   pb.status_message, "" if status is grpc.StatusCode.OK else status.name,
                   logprobs_from_pb(pb.logprobs), logprobs_from_pb(pb.prompt_logprobs),
                   pb.index)


def merge_deltas(first: TokenDelta, second: TokenDelta) -> TokenDelta:
    """One delta carrying ``first``'s then ``second``'s tokens (and their
    log-probabilities, and the prompt's from whichever carries them), with
    ``second``'s counts, finish reason and error (same request and choice):
    what an outbox or inbox holds while its reader is slow."""
    return replace(second, token_ids=first.token_ids + second.token_ids,
                   logprobs=first.logprobs + second.logprobs,
                   prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs)


def pack_requests(items: list[EngineStart | StreamCancel]) -> list[engine_pb2.MultiplexRequest]:
    """Queued starts and cancels as ``MultiplexRequest`` messages: the cancels
    in the first; the starts in order, as many per message as fit in about
    :data:`MESSAGE_BYTES` (at least one), so that a burst of long prompts never
    becomes one huge message that holds up the call."""
    messages = [engine_pb2.MultiplexRequest()]
    size = 0
    for item in items:
        if isinstance(item, StreamCancel):
            if item.index is None:
                messages[0].cancels.append(item.stream_id)
            else:
                messages[0].cancel_choices.add(stream_id=item.stream_id, index=item.index)
            continue
        size += item.wire_bytes
        if messages[-1].starts and size > MESSAGE_BYTES:
            messages.append(engine_pb2.MultiplexRequest())
            size = item.wire_bytes
        messages[-1].starts.append(item.to_pb())
    return messages


def unpack_requests(message: engine_pb2.MultiplexRequest
                    ) -> tuple[list[EngineStart], list[StreamCancel]]:
    """A ``MultiplexRequest``'s starts, and its cancels (whole streams first,
    then single choices)."""
    cancels = [StreamCancel(stream_id) for stream_id in message.cancels]
    cancels += [StreamCancel(c.stream_id, c.index) for c in message.cancel_choices]
    return [EngineStart.from_pb(start) for start in message.starts], cancels


def pack_updates(pending: dict[tuple[int, int], TokenDelta]
                 ) -> tuple[engine_pb2.MultiplexResponse]:
    """An outbox's pending deltas (by stream id and choice) as one message."""
    return (engine_pb2.MultiplexResponse(
        updates=[delta.to_pb(stream_id) for (stream_id, _), delta in pending.items()]),)


def unpack_updates(message: engine_pb2.MultiplexResponse) -> Iterable[tuple[int, TokenDelta]]:
    """A ``MultiplexResponse``'s deltas with their stream ids."""
    return [(u.stream_id, TokenDelta.from_pb(u)) for u in message.updates]
