"""The router's client of one engine replica: every request on one ``Multiplex`` call.

:class:`EngineClient` keeps one long-lived ``Multiplex`` call per replica
(opened on first use, opened again after it fails) instead of a ``Generate``
stream per request: a request's start costs no new HTTP/2 stream, and an
engine step arrives as one message carrying the updates of every request of
this router that advanced in it. The call is the stream kit's
:class:`MuxClient` (:mod:`services.common.mux`) speaking
:mod:`services.common.wire.engine_stream`: its reader hands each update to its
:class:`EngineStream`; its writer sends the starts and cancels that piled up
while it was busy as one message.

Coalescing toward slow clients: an :class:`EngineStream`'s inbox merges the
updates that arrive while its consumer is busy (writing to a client that reads
slowly) into one :class:`TokenDelta` per choice (:func:`merge_deltas`), so a
slow client gets fewer, larger messages and a stream holds at most its
generated ids, never a queue of messages.

Errors: a request's own status (queue full, bad ids, its deadline) ends only
that request's stream, as :class:`UpstreamError` with the engine's code; a
failed call (engine gone) ends every request open on it with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc

from llmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.grpc_util import make_channel
from services.common.mux import MuxClient, StreamInbox
from services.common.sampling import FinishReason, Priority, SamplingOptions, SpeculativeOptions
from services.common.wire.engine_stream import (
    EngineStart,
    StreamCancel,
    TokenDelta,
    merge_deltas,
    pack_requests,
    unpack_updates,
)
from services.common.wire.engine_info import LoadStats, ModelInfo
from services.router.clients import (
    UpstreamError,
    timeout_until,
    upstream_error,
    wait_until_serving,
)
from services.router.load_watch import LoadWatch

_SERVICE = "engine"


class EngineStream:
    """One request on a replica's ``Multiplex`` call (a :class:`Receiver` of
    the call's :class:`MuxClient`).

    Read the engine's :class:`TokenDelta` values (as the wire decoded them,
    handed on without a copy) with :meth:`read` until each of the request's
    ``n`` choices (``sampling.n``; one unless set) had one carrying a
    ``finish_reason``; a read returns one choice's updates merged (choices in
    the order their updates arrived). :meth:`cancel` asks the engine to finish
    the sequence at once (its KV blocks are freed), :meth:`cancel_choice` one
    choice alone; :meth:`close` must run in a ``finally`` (it cancels a
    request that has not finished).
    """

    def __init__(self, mux: MuxClient[EngineStart | StreamCancel, TokenDelta],
                 stream_id: int, make_error: Callable[[grpc.StatusCode, str], UpstreamError],
                 deadline: float | None, n: int = 1) -> None:
        self._mux = mux
        self.stream_id = stream_id
        self._make_error = make_error
        self._inbox: StreamInbox[int, TokenDelta] = StreamInbox(merge_deltas)  # by choice
        self._choices_left = n
        # The router's own clock for this hop (the engine also gets timeout_ms):
        # the request ends DEADLINE_EXCEEDED on time whatever the engine does.
        self._timer = (None if deadline is None else
                       asyncio.get_running_loop().call_at(deadline, self._expire))

    def _expire(self) -> None:
        if not self._inbox.done:
            self.fail(self._make_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       "the call's deadline passed before the engine finished"))
            self._mux.send(StreamCancel(self.stream_id))

    # ---- fed by the call's reader (Receiver) -----------------------------------------

    def deliver(self, update: TokenDelta) -> bool:
        """Merges ``update``; returns True when it is the request's last (an
        error, or its last choice's finish)."""
        status = update.status
        if status is not grpc.StatusCode.OK:
            if update.token_ids:
                self._inbox.put(update.index, replace(update, finish_reason=FinishReason.NONE,
                                                      error="", error_status=""))
            self.fail(self._make_error(status, update.error))
            return True
        last = update.finished
        self._choices_left -= last
        self._inbox.put(update.index, update, last=self._choices_left <= 0)
        if self._inbox.done and self._timer is not None:
            self._timer.cancel()
        return self._inbox.done

    def fail(self, error: BaseException) -> None:
        """Ends the stream with ``error`` (the call failed, or its deadline passed)."""
        self._inbox.fail(error)
        if self._timer is not None:
            self._timer.cancel()

    # ---- the request's side ----------------------------------------------------------

    async def read(self) -> TokenDelta:
        """Everything that arrived since the previous read for the first choice
        that has news, as one update (waits for at least one). Ids that came
        before an error are returned first; the error on the next read.

        Raises:
          UpstreamError: the request's status from the engine (UNAVAILABLE,
            RESOURCE_EXHAUSTED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, INTERNAL
            ...), or UNAVAILABLE when the call failed.
        """
        while True:
            _, update = await self._inbox.read()
            if self._inbox.error is not None and update.finished:
                # the error says how it ended
                update = replace(update, finish_reason=FinishReason.NONE)
            if not update.is_empty:
                return update

    async def flush(self) -> None:
        """Lets the start (and anything else queued on the call) leave now,
        before the caller's next step (:meth:`MuxClient.flush`)."""
        await self._mux.flush()

    async def cancel(self) -> None:
        """Tells the engine to finish the sequence now."""
        self.close()

    def cancel_choice(self, index: int) -> None:
        """Tells the engine to finish choice ``index`` alone now (its blocks are
        freed, the other choices go on); its last update still arrives (CANCELLED,
        unless it finished first)."""
        if not self._inbox.done:
            self._mux.send(StreamCancel(self.stream_id, index))

    def close(self) -> None:
        """Cancels the request unless it has finished (safe to call twice): after
        its last update the engine is done with it, and a cancel then would only
        cost a message."""
        if not self._inbox.done:
            self._inbox.done = True
            self._mux.send(StreamCancel(self.stream_id))
        if self._timer is not None:
            self._timer.cancel()
        self._mux.forget(self.stream_id)


@dataclass(eq=False)
class OpenRequest:
    """One request this router has open on a replica (:meth:`EngineClient.opened`):
    its sequences (one per choice) and how far each got, so the router can
    bound when one of them frees its slot (:mod:`services.router.routing`).

    Attributes:
      priority: its traffic class.
      max_tokens: most tokens each choice may generate (0: not known).
      generated: tokens each choice generated so far (by choice index).
      finished: the choices whose sequence ended (their slot is free in the
        engine, though the request is open until its last choice ends).
    """

    priority: Priority
    max_tokens: int
    generated: list[int]
    finished: set[int] = field(default_factory=set)

    @property
    def choices(self) -> int:
        return len(self.generated)

    def advance(self, index: int, tokens: int, finished: bool = False) -> None:
        """Choice ``index`` generated ``tokens`` more (and ended, when ``finished``)."""
        if 0 <= index < len(self.generated):
            self.generated[index] += tokens
            if finished:
                self.finished.add(index)

    def tokens_left(self) -> list[int]:
        """Per choice, the most tokens it may still generate before its slot
        frees: ``max_tokens`` less what it generated (0 once it ended); empty
        when ``max_tokens`` is not known. A bound: EOS or a stop may end it sooner."""
        if self.max_tokens <= 0:
            return []
        return [0 if i in self.finished else max(self.max_tokens - done, 0)
                for i, done in enumerate(self.generated)]


class EngineClient:
    """Client of one ``llmesh.v1.EngineService`` replica on one long-lived channel.

    Attributes:
      in_flight: requests this router has open on the replica (a cheap local
        load signal used to pick the least loaded replica).
      in_flight_interactive: of those, the interactive ones (an interactive
        request goes where the fewest are: batch ones are preempted for it).
      sequences: engine sequence slots those requests hold (one per choice:
        a request with ``n`` choices runs ``n`` sequences).
      sequences_interactive: of those, the interactive requests' ones.
      open_requests: those requests (:class:`OpenRequest`: how far each got).
      on_call_failed: called with the reason when a ``Multiplex`` call fails
        (not when the router closes it): the replica set takes the replica
        out of routing (:mod:`services.router.replicas`).
      info: the replica's last ``GetModelInfo`` answer (None before the first).
      load_watch: its live load (:mod:`services.router.load_watch`), followed
        once :meth:`LoadWatch.start` is called.
    """

    service = _SERVICE

    def __init__(self, target: str) -> None:
        """Args:
          target: ``host:port`` of the engine replica.
        """
        self.target = target
        self.in_flight = 0
        self.in_flight_interactive = 0
        self.sequences = 0
        self.sequences_interactive = 0
        self.open_requests: set[OpenRequest] = set()
        self._channel = make_channel(target)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._mux: MuxClient[EngineStart | StreamCancel, TokenDelta] | None = None
        self._stream_ids = itertools.count(1)
        self.on_call_failed: Callable[[str], None] | None = None
        self.info: ModelInfo | None = None
        self.load_watch = LoadWatch(self._channel, target)

    def opened(self, priority: Priority, choices: int = 1, max_tokens: int = 0) -> OpenRequest:
        """Counts a request of ``choices`` sequences of at most ``max_tokens``
        tokens each (0: not known) this router opens on the replica (see
        ``in_flight``, ``sequences`` and ``open_requests``); returns its record,
        for :meth:`OpenRequest.advance` and :meth:`closed`."""
        interactive = priority is Priority.INTERACTIVE
        self.in_flight += 1
        self.in_flight_interactive += interactive
        self.sequences += choices
        self.sequences_interactive += choices * interactive
        request = OpenRequest(priority, max_tokens, [0] * choices)
        self.open_requests.add(request)
        return request

    def closed(self, request: OpenRequest) -> None:
        """Uncounts a request :meth:`opened` counted (once); its sequences'
        slots count as free in the replica's load view until its next report
        (:meth:`LoadWatch.ended`)."""
        if request not in self.open_requests:
            return
        self.open_requests.discard(request)
        self.load_watch.ended(request.choices)
        interactive = request.priority is Priority.INTERACTIVE
        self.in_flight -= 1
        self.in_flight_interactive -= interactive
        self.sequences -= request.choices
        self.sequences_interactive -= request.choices * interactive

    def tokens_left(self, priority: Priority) -> list[int]:
        """The sequences this router runs on the replica that hold a slot
        against a request of ``priority`` (an interactive one: only the
        interactive ones, the engine preempts batch sequences for it), each as
        the most tokens it may still generate (:meth:`OpenRequest.tokens_left`;
        those of unknown length are left out), in ascending order."""
        interactive = priority is Priority.INTERACTIVE
        return sorted(left for request in self.open_requests
                      if not interactive or request.priority is Priority.INTERACTIVE
                      for left in request.tokens_left())

    @property
    def channel(self) -> grpc.aio.Channel:
        """The replica's channel (its health is probed on it)."""
        return self._channel

    def fail_calls(self, why: str) -> None:
        """Ends the open ``Multiplex`` call, if any: each request on it gets
        UNAVAILABLE with ``why``; the next start opens a new call."""
        if self._mux is not None:
            self._mux.fail(why)

    async def wait_until_serving(self, timeout: float) -> None:
        """See :func:`services.router.clients.wait_until_serving`."""
        await wait_until_serving(self._channel, service=self.service, target=self.target,
                                 timeout=timeout)

    async def model_info(self, *, timeout: float | None = 10.0) -> ModelInfo:
        """``GetModelInfo``, remembered as :attr:`info`. Raises :class:`UpstreamError`."""
        try:
            reply = await self._stub.GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                  timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise upstream_error(self.service, self.target, err) from err
        self.info = ModelInfo.from_pb(reply)
        return self.info

    async def load(self, *, timeout: float | None = 1.0) -> LoadStats:
        """``GetLoad``. Raises :class:`UpstreamError`."""
        try:
            reply = await self._stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise upstream_error(self.service, self.target, err) from err
        return LoadStats.from_pb(reply)

    def start(
        self, prompt_token_ids: Sequence[int], sampling: SamplingOptions, *,
        priority: Priority, request_id: str, deadline: float | None,
        speculative: SpeculativeOptions | None = None, tenant: str = "",
        cache_scope: str = "", traceparent: str = "",
    ) -> EngineStream:
        """Starts the request on the replica's ``Multiplex`` call (opened now if
        there is none, or the last one failed); ``speculative``: the request's
        speculative decoding switch, None for the engine's defaults;
        ``tenant``: whose request it is ("" for none); ``cache_scope``: its
        cache scope (:mod:`services.common.cache_scope`; the engine reuses KV
        blocks and suffix-cache outputs only within it); ``traceparent``:
        the router's span the engine's spans are children of (W3C, "" when
        not traced). The start
        is written by the call's writer task (await :meth:`EngineStream.flush`
        to have it written before going on); the engine's refusals arrive on
        the first :meth:`EngineStream.read`.

        Raises:
          UpstreamError: DEADLINE_EXCEEDED when ``deadline`` has passed.
        """
        remaining = timeout_until(deadline)
        request = engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            sampling=sampling.to_pb(), priority=priority.to_pb(), tenant=tenant,
            cache_scope=cache_scope)
        if speculative is not None and speculative != SpeculativeOptions():
            request.speculative.CopyFrom(speculative.to_pb())
        stream_id = next(self._stream_ids)
        start = EngineStart(stream_id, request,
                            0 if remaining is None else max(1, int(remaining * 1e3)),
                            traceparent)
        if self._mux is None or self._mux.failed is not None:
            self._mux = MuxClient(self._stub.Multiplex(), pack=pack_requests,
                                  unpack=unpack_updates, make_error=self._error,
                                  service=_SERVICE, target=self.target,
                                  on_failed=self._call_failed)
        stream = EngineStream(self._mux, stream_id, self._error, deadline, sampling.n)
        self._mux.open(stream_id, stream, start)
        return stream

    @property
    def unsent(self) -> int:
        """Starts and cancels queued on the replica's call and not yet written
        (0 without a call)."""
        return 0 if self._mux is None else self._mux.queued

    @property
    def replica_id(self) -> str:
        """The replica's id from ``GetModelInfo`` (what a client may be told;
        never the address), "" before the first answer or when it sends none."""
        return "" if self.info is None else self.info.replica_id

    def _error(self, code: grpc.StatusCode, details: str) -> UpstreamError:
        return UpstreamError(_SERVICE, self.target, code, details, replica=self.replica_id)

    def _call_failed(self, why: str) -> None:
        if self.on_call_failed is not None:
            self.on_call_failed(why)

    async def close(self) -> None:
        await self.load_watch.close()
        if self._mux is not None:
            await self._mux.close()
        await self._channel.close()
