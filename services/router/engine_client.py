"""The router's client of one engine replica: every request on one ``Multiplex`` call.

:class:`EngineClient` keeps one long-lived ``Multiplex`` call per replica
(opened on first use, opened again after it fails) instead of a ``Generate``
stream per request: a request's start costs no new HTTP/2 stream, and an
engine step arrives as one message carrying the updates of every request of
this router that advanced in it. One reader task hands each update to its
:class:`EngineStream`; one writer task sends the starts and cancels that
piled up while it was busy as one message.

Coalescing toward slow clients: an :class:`EngineStream` merges the updates
that arrive while its consumer is busy (writing to a client that reads
slowly) into one :class:`EngineDelta`, so a slow client gets fewer, larger
messages and a stream holds at most its generated ids, never a queue of
messages.

Errors: a request's own status (queue full, bad ids, its deadline) ends only
that request's stream, as :class:`UpstreamError` with the engine's code; a
failed call (engine gone) ends every request open on it with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections.abc import Callable, Sequence

import grpc
import structlog

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.grpc_util import make_channel, status_code_of
from services.common.logprobs import logprobs_from_pb
from services.common.sampling import FinishReason, Priority, SamplingOptions, SpeculativeOptions
from services.router.clients import (
    EngineDelta,
    EngineLoad,
    ReplicaInfo,
    UpstreamError,
    Usage,
    finish_reason_of,
    timeout_until,
    upstream_error,
    wait_until_serving,
)
from services.router.load_watch import LoadWatch, load_from_pb

log = structlog.get_logger()

_SERVICE = "engine"
#: About the most bytes of starts the router puts in one Multiplex message.
_MESSAGE_BYTES = 1 << 20


class _ChoiceUpdates:
    """What arrived for one choice of a stream and was not read yet."""

    __slots__ = ("ids", "logprobs", "prompt_logprobs", "finish")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[common_pb2.PositionLogprobs] = []
        self.prompt_logprobs: list[common_pb2.PositionLogprobs] = []
        self.finish: FinishReason | None = None


class EngineStream:
    """One request on a replica's ``Multiplex`` call.

    Read :class:`EngineDelta` values with :meth:`read` until each of the
    request's ``n`` choices (``sampling.n``; one unless set) had one carrying a
    ``finish_reason``; a read returns one choice's updates merged (choices in
    the order their updates arrived). :meth:`cancel` asks the engine to finish
    the sequence at once (its KV blocks are freed), :meth:`cancel_choice` one
    choice alone; :meth:`close` must run in a ``finally`` (it cancels a
    request that has not finished).
    """

    def __init__(self, mux: _Multiplex, stream_id: int, target: str,
                 deadline: float | None, n: int = 1) -> None:
        self._mux = mux
        self.stream_id = stream_id
        self.target = target
        self._unread: dict[int, _ChoiceUpdates] = {}  # by choice, in arrival order
        self._usage: dict[int, Usage] = {}
        self._choices_left = n
        self._error: UpstreamError | None = None
        self._arrived = asyncio.Event()
        self._done = False  # the engine will send nothing more
        # The router's own clock for this hop (the engine also gets timeout_ms):
        # the request ends DEADLINE_EXCEEDED on time whatever the engine does.
        self._timer = (None if deadline is None else
                       asyncio.get_running_loop().call_at(deadline, self._expire))

    def _expire(self) -> None:
        if not self._done:
            self._fail(UpstreamError(_SERVICE, self.target, grpc.StatusCode.DEADLINE_EXCEEDED,
                                     "the call's deadline passed before the engine finished"))
            self._mux.cancel(self.stream_id)

    # ---- fed by the call's reader ----------------------------------------------------

    def _update(self, update: engine_pb2.SequenceUpdate) -> bool:
        """Merges ``update``; returns True when it is the request's last (an
        error, or its last choice's finish)."""
        if update.HasField("usage"):
            u = update.usage
            self._usage[update.index] = Usage(u.prompt_tokens, u.completion_tokens,
                                              u.cached_prompt_tokens)
        if update.token_ids or update.finish_reason:
            unread = self._unread.setdefault(update.index, _ChoiceUpdates())
            unread.ids.extend(update.token_ids)
            unread.logprobs.extend(update.logprobs)
            unread.prompt_logprobs.extend(update.prompt_logprobs)
            if update.finish_reason and not update.status_code:
                unread.finish = finish_reason_of(update.finish_reason)
                self._choices_left -= 1
        if update.status_code:
            self._error = UpstreamError(_SERVICE, self.target,
                                        status_code_of(update.status_code),
                                        update.status_message)
        if update.status_code or self._choices_left <= 0:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
        self._arrived.set()
        return self._done

    def _fail(self, error: UpstreamError) -> None:
        if not self._done:
            self._error, self._done = error, True
            self._arrived.set()
        if self._timer is not None:
            self._timer.cancel()

    # ---- the request's side ----------------------------------------------------------

    async def read(self) -> EngineDelta:
        """Everything that arrived since the previous read, as one delta (waits
        for at least one update). Ids that came before an error are returned
        first; the error on the next read.

        Raises:
          UpstreamError: the request's status from the engine (UNAVAILABLE,
            RESOURCE_EXHAUSTED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, INTERNAL
            ...), or UNAVAILABLE when the call failed.
        """
        while not (self._unread or self._error is not None):
            self._arrived.clear()
            await self._arrived.wait()
        if self._error is not None and not any(u.ids for u in self._unread.values()):
            raise self._error
        index = next(iter(self._unread))
        unread = self._unread.pop(index)
        finish = None if self._error is not None else unread.finish
        return EngineDelta(tuple(unread.ids), finish, self._usage.get(index),
                           logprobs_from_pb(unread.logprobs),
                           logprobs_from_pb(unread.prompt_logprobs), index=index)

    async def cancel(self) -> None:
        """Tells the engine to finish the sequence now."""
        self.close()

    def cancel_choice(self, index: int) -> None:
        """Tells the engine to finish choice ``index`` alone now (its blocks are
        freed, the other choices go on); its last update still arrives (CANCELLED,
        unless it finished first)."""
        if not self._done:
            self._mux.cancel_choice(self.stream_id, index)

    def close(self) -> None:
        """Cancels the request unless it has finished (safe to call twice): after
        its last update the engine is done with it, and a cancel then would only
        cost a message."""
        if not self._done:
            self._done = True
            self._mux.cancel(self.stream_id)
        if self._timer is not None:
            self._timer.cancel()
        self._mux.forget(self.stream_id)


class _Multiplex:
    """One ``Multiplex`` call and the streams open on it (owned by :class:`EngineClient`)."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub, target: str,
                 on_failed: Callable[[str], None] | None = None) -> None:
        self._target = target
        self._on_failed = on_failed
        self._call = stub.Multiplex()
        self._streams: dict[int, EngineStream] = {}
        self._starts: list[engine_pb2.MultiplexStart] = []
        self._cancels: list[int] = []
        self._choice_cancels: list[engine_pb2.ChoiceCancel] = []
        self._wake = asyncio.Event()
        self.failed: UpstreamError | None = None
        self._closing = False
        # A context of their own: the tasks serve every request, so they must
        # not carry the request id of the one that happened to open the call.
        self._reader = asyncio.create_task(self._read(), context=contextvars.Context())
        self._writer = asyncio.create_task(self._write(), context=contextvars.Context())

    def open(self, stream_id: int, start: engine_pb2.MultiplexStart,
             deadline: float | None) -> EngineStream:
        n = start.request.sampling.n if start.request.sampling.HasField("n") else 1
        stream = EngineStream(self, stream_id, self._target, deadline, n)
        self._streams[stream_id] = stream
        self._starts.append(start)
        self._wake.set()
        return stream

    def cancel(self, stream_id: int) -> None:
        if self.failed is None:
            self._cancels.append(stream_id)
            self._wake.set()

    def cancel_choice(self, stream_id: int, index: int) -> None:
        if self.failed is None:
            self._choice_cancels.append(engine_pb2.ChoiceCancel(stream_id=stream_id,
                                                                index=index))
            self._wake.set()

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._starts or self._cancels or self._choice_cancels:
                    await self._call.write(self._next_message())
        except grpc.aio.AioRpcError as err:
            self._fail_all(f"writing to it failed: {err.code().name}: {err.details()}")
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as err:
            self._fail_all(f"writing to it failed: {type(err).__name__}: {err}")

    def _next_message(self) -> engine_pb2.MultiplexRequest:
        """The pending cancels and as many pending starts as fit in about
        :data:`_MESSAGE_BYTES` (at least one), so that a burst of long prompts
        never becomes one huge message that holds up the call."""
        size, count = 0, 0
        for start in self._starts:
            size += 64 + 5 * len(start.request.prompt_token_ids)
            if count and size > _MESSAGE_BYTES:
                break
            count += 1
        message = engine_pb2.MultiplexRequest(starts=self._starts[:count],
                                              cancels=self._cancels,
                                              cancel_choices=self._choice_cancels)
        self._starts, self._cancels, self._choice_cancels = self._starts[count:], [], []
        return message

    async def _read(self) -> None:
        why = "the engine ended the Multiplex call"
        code = grpc.StatusCode.UNAVAILABLE
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                for update in message.updates:
                    stream = self._streams.get(update.stream_id)
                    if stream is not None and stream._update(update):
                        del self._streams[update.stream_id]
        except grpc.aio.AioRpcError as err:
            why = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            self._fail_all("the router closed the call", code)
            raise
        self._fail_all(why, code)

    def _fail_all(self, why: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, *,
                  by_router: bool = False) -> None:
        if self.failed is None:
            what = "the router ended the Multiplex call" if by_router else \
                "the Multiplex call failed"
            self.failed = UpstreamError(_SERVICE, self._target, code, f"{what}: {why}")
            if not self._closing:
                log.warning("engine_call_failed", engine=self._target, why=why,
                            open_requests=len(self._streams))
                if self._on_failed is not None:
                    self._on_failed(why)
        for stream in self._streams.values():
            stream._fail(self.failed)
        self._streams.clear()
        self._call.cancel()
        current = asyncio.current_task()
        for task in (self._reader, self._writer):
            if task is not current:
                task.cancel()

    def fail(self, why: str) -> None:
        """Ends the call and every stream on it with UNAVAILABLE (the replica went
        silent)."""
        if self.failed is None:
            self._fail_all(why, by_router=True)

    async def close(self) -> None:
        self._closing = True
        self._call.cancel()
        for task in (self._reader, self._writer):
            task.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class EngineClient:
    """Client of one ``llmesh.v1.EngineService`` replica on one long-lived channel.

    Attributes:
      in_flight: requests this router has open on the replica (a cheap local
        load signal used to pick the least loaded replica).
      in_flight_interactive: of those, the interactive ones (an interactive
        request goes where the fewest are: batch ones are preempted for it).
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
        self._channel = make_channel(target)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._mux: _Multiplex | None = None
        self._stream_ids = itertools.count(1)
        self.on_call_failed: Callable[[str], None] | None = None
        self.info: ReplicaInfo | None = None
        self.load_watch = LoadWatch(self._channel, target)

    def opened(self, priority: Priority) -> None:
        """Counts a request this router opens on the replica (see ``in_flight``)."""
        self.in_flight += 1
        self.in_flight_interactive += priority is Priority.INTERACTIVE

    def closed(self, priority: Priority) -> None:
        """Uncounts a request counted by :meth:`opened`."""
        self.in_flight -= 1
        self.in_flight_interactive -= priority is Priority.INTERACTIVE

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

    async def model_info(self, *, timeout: float | None = 10.0) -> ReplicaInfo:
        """``GetModelInfo``, remembered as :attr:`info`. Raises :class:`UpstreamError`."""
        try:
            reply = await self._stub.GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                  timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise upstream_error(self.service, self.target, err) from err
        self.info = ReplicaInfo(
            reply.model, reply.max_model_len, reply.vocab_size, tuple(reply.eos_token_ids),
            reply.backend, reply.max_num_seqs, reply.kv_capacity_tokens, reply.replica_id,
            reply.kv_block_size, reply.kv_hash_seed)
        return self.info

    async def load(self, *, timeout: float | None = 1.0) -> EngineLoad:
        """``GetLoad``. Raises :class:`UpstreamError`."""
        try:
            reply = await self._stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise upstream_error(self.service, self.target, err) from err
        return load_from_pb(reply)

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
        is written by the call's writer task; the engine's refusals arrive on
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
        start = engine_pb2.MultiplexStart(
            stream_id=stream_id, request=request, traceparent=traceparent,
            timeout_ms=0 if remaining is None else max(1, int(remaining * 1e3)))
        if self._mux is None or self._mux.failed is not None:
            self._mux = _Multiplex(self._stub, self.target, self._call_failed)
        return self._mux.open(stream_id, start, deadline)

    def _call_failed(self, why: str) -> None:
        if self.on_call_failed is not None:
            self.on_call_failed(why)

    async def close(self) -> None:
        await self.load_watch.close()
        if self._mux is not None:
            await self._mux.close()
        await self._channel.close()
