"""The messages of the engine's ``Multiplex`` call, as both ends use them.

The router (:mod:`services.router.engine_client`) sends :class:`EngineStart`
and :class:`StreamCancel`; the engine (:mod:`services.engine.multiplex`)
answers with :class:`EngineUpdate` values, merged per stream and choice with
:func:`merge_updates` while the other end reads slowly (in the engine's outbox
and in the router's per-request inbox, both :class:`services.common.mux.Mailbox`).
The ``pack_*``/``unpack_*`` functions are the two edges where protobuf is made
and read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class EngineUpdate:
    """What one choice of a stream did since its previous update.

    Attributes:
      stream_id: the stream's id.
      token_ids: ids produced since the previous update.
      finish_reason: set on the choice's last update (None before).
      usage: running token counts (None on a status-only update).
      logprobs: with ``sampling.logprobs``: one entry per id.
      prompt_logprobs: with ``sampling.prompt_logprobs``: on choice 0's first.
      index: the choice (0..n-1).
      status: OK unless the request ended with an error (then its last update:
        the status the request ends with, and ``message``).
    """

    stream_id: int
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    index: int = 0
    status: grpc.StatusCode = grpc.StatusCode.OK
    message: str = ""

    @property
    def is_empty(self) -> bool:
        """Carries no ids, logprobs, finish or status (running counts only)."""
        return not (self.token_ids or self.finish_reason is not None or self.logprobs
                    or self.prompt_logprobs or self.status is not grpc.StatusCode.OK)

    def to_pb(self) -> engine_pb2.SequenceUpdate:
        update = engine_pb2.SequenceUpdate(
            stream_id=self.stream_id, index=self.index, token_ids=self.token_ids,
            logprobs=logprobs_to_pb(self.logprobs),
            prompt_logprobs=logprobs_to_pb(self.prompt_logprobs),
            finish_reason=int(self.finish_reason or FinishReason.NONE),
            status_code=self.status.value[0], status_message=self.message)
        if self.usage is not None:
            update.usage.CopyFrom(self.usage.to_pb())
        return update

    @classmethod
    def from_pb(cls, pb: engine_pb2.SequenceUpdate) -> EngineUpdate:
        try:
            finish: FinishReason | None = FinishReason(pb.finish_reason) or None
        except ValueError:  # a newer engine's reason: it ended, we cannot say why
            finish = FinishReason.ERROR
        return cls(pb.stream_id, tuple(pb.token_ids), finish,
                   Usage.from_pb(pb.usage) if pb.HasField("usage") else None,
                   logprobs_from_pb(pb.logprobs), logprobs_from_pb(pb.prompt_logprobs),
                   pb.index, status_code_of(pb.status_code), pb.status_message)


def merge_updates(pending: EngineUpdate, later: EngineUpdate) -> EngineUpdate:
    """One update saying what ``pending`` then ``later`` (same stream and
    choice) say: ids and logprobs in order, the latest counts, the finish and
    status once set."""
    return EngineUpdate(
        pending.stream_id, pending.token_ids + later.token_ids,
        later.finish_reason if later.finish_reason is not None else pending.finish_reason,
        later.usage if later.usage is not None else pending.usage,
        pending.logprobs + later.logprobs, pending.prompt_logprobs + later.prompt_logprobs,
        pending.index,
        later.status if later.status is not grpc.StatusCode.OK else pending.status,
        later.message or pending.message)


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


def pack_updates(pending: dict[tuple[int, int], EngineUpdate]
                 ) -> tuple[engine_pb2.MultiplexResponse]:
    """An outbox's pending updates (by stream id and choice) as one message."""
    return (engine_pb2.MultiplexResponse(updates=[u.to_pb() for u in pending.values()]),)


def unpack_updates(message: engine_pb2.MultiplexResponse) -> Iterable[tuple[int, EngineUpdate]]:
    """A ``MultiplexResponse``'s updates with their stream ids."""
    return [(u.stream_id, EngineUpdate.from_pb(u)) for u in message.updates]
