"""``EngineService``: the gRPC edge of one engine replica (``llmesh.v1.EngineService``).

Converts protobuf to engine types (validating every field), runs the request on
an :class:`EngineBackend` and streams its deltas back. Statuses:

* INVALID_ARGUMENT: first message not ``start``, a second ``start``, an empty
  prompt, a token id outside the vocabulary, a malformed sampling field (the
  message names the field, e.g. ``sampling.top_p: must be in (0, 1], got 0``);
* OUT_OF_RANGE: ``sampling.max_tokens`` above the cap, prompt + max_tokens
  beyond the context window, or a request that needs more KV slots than the
  replica's whole KV cache (it could never run; the message says the largest
  value that fits);
* RESOURCE_EXHAUSTED: the waiting queue is full; ALREADY_EXISTS: the request id
  is in flight; UNAVAILABLE: loading or draining; INTERNAL: the engine failed
  the request (a last message with FINISH_REASON_ERROR comes first).

A ``cancel`` message or the client dropping the call finishes the sequence at
once (the backend frees it at its next step).

Logs: every admitted request writes exactly one ``request_finished`` line
(``outcome``: stop, length, cancelled or error; its token counts; for a cancel,
``cancelled_by``: ``cancel_message``, ``call_dropped`` or ``deadline_exceeded``),
however it ends; a refused one writes ``request_rejected`` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common import tracing
from services.common.cache_scope import check_scope
from services.common.grpc_util import request_id_from
from services.common.logging import bind_request_id
from services.common.logprobs import logprobs_to_pb
from services.common.sampling import (
    FinishReason,
    InvalidRequestError,
    Priority,
    SamplingOptions,
    SpeculativeOptions,
)
from services.engine.backend import EngineBackend, EngineUnavailableError
from services.engine.config import EngineConfig
from services.engine.metrics import EngineMetrics, default_metrics
from services.engine.multiplex import MultiplexCall
from services.engine.delta_stream import DeltaStream
from services.engine.request_record import RequestFailed, RequestRecord
from services.engine.request_sink import RequestSink
from services.engine.kv_publisher import KvEventPublisher, PublisherIdentity
from services.engine.types import LoadStats, SequenceRequest, TokenDelta

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
log = structlog.get_logger()

_Requests = AsyncIterator[engine_pb2.EngineServiceGenerateRequest]
#: StreamLoad's defaults: fewest / most milliseconds between two messages.
_LOAD_INTERVAL_MS = 20
#: Longest ``EngineRequest.tenant`` accepted (an id, not a payload).
MAX_TENANT_BYTES = 256
_LOAD_HEARTBEAT_MS = 500
_LOAD_MIN_MS, _LOAD_MAX_MS = 5, 60_000


class EngineLoadError(Exception):
    """The backend could not load the model for a reason its message names (a
    missing or malformed file, options the model refutes, an unavailable
    backend); already logged as ``engine_load_failed``."""

    #: The server kit adds no ``start_failed`` line and re-raises it
    #: (``services.common.server.LOGGED_ATTRIBUTE``).
    logged = True


class EngineService(engine_pb2_grpc.EngineServiceServicer):
    """The engine's servicer and :class:`services.common.server.Service`.

    Args:
      backend: the model replica (started by :meth:`start`).
      config: limits for requests (default / cap of max_tokens).
      metrics: where to count requests and tokens (default: the process-wide
        set on Prometheus' default registry).
    """

    service_names = (SERVICE_NAME,)

    def __init__(self, backend: EngineBackend, config: EngineConfig | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        self._backend = backend
        self._config = config or EngineConfig()
        self._metrics = metrics if metrics is not None else default_metrics()
        self._ready = False
        self._draining = False
        self.replica_id = self._config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.epoch = time.time_ns()
        self._publisher: KvEventPublisher | None = None
        self._stopping = asyncio.Event()  # ends StreamLoad calls on drain

    # ---- Service protocol ---------------------------------------------------------

    def register(self, server: grpc.aio.Server) -> None:
        """Adds this servicer to ``server``."""
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Starts the backend (load + warm-up); Generate is served afterwards.

        Raises:
          EngineLoadError: a ValueError, OSError or EngineUnavailableError from
            the load, logged first as one ``engine_load_failed`` line with its
            message (other exceptions propagate as they are).
        """
        try:
            await self._backend.start()
        except (ValueError, OSError, EngineUnavailableError) as exc:
            log.error("engine_load_failed", error=str(exc), error_type=type(exc).__name__)
            raise EngineLoadError(str(exc)) from exc
        self._metrics.track_load(self._backend.load)
        self._metrics.track_blocks(self._backend.kv_block_counts)
        self._metrics.observe_resources(self._backend.resources())
        self._ready = True
        info = self._backend.model_info
        fields = {"dtype": self._config.dtype, "quantization": self._config.quantization,
                  **self._backend.startup_fields()}  # the backend's: resolved at start
        log.info("engine_ready", model=info.model, backend=info.backend,
                 max_model_len=info.max_model_len, replica_id=self.replica_id, **fields,
                 **_timings(getattr(self._backend, "timings", None)))
        target = self._config.kv_events_target
        if target and info.kv_block_size:
            self._publisher = KvEventPublisher(self._backend, target, PublisherIdentity(
                self.replica_id, self.epoch, info.model, info.kv_block_size,
                info.kv_capacity_tokens // info.kv_block_size, info.kv_offload_blocks),
                self._metrics)
            self._publisher.start()

    async def drain(self) -> None:
        """New Generate calls get UNAVAILABLE; running ones finish; StreamLoad
        calls end."""
        self._draining = True
        self._stopping.set()

    async def close(self) -> None:
        """Stops publishing KV events (the index drops this replica), then shuts
        the backend down."""
        if self._publisher is not None:
            await self._publisher.close()
        await self._backend.shutdown()

    # ---- RPCs ---------------------------------------------------------------------

    async def Generate(self, request_iterator: _Requests, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[engine_pb2.EngineServiceGenerateResponse]:
        """Bidi stream of one request: ``start``, then optionally ``cancel``.
        Deprecated in the proto (the router calls :meth:`Multiplex`); kept for
        one-request callers (grpcurl, tests, ``benchmarks/mesh_latency.py``)."""
        await self._check_admitting(context)
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("action") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "start: the first message of a Generate stream must be `start`")
        request_id = request_id_from(context, first.start.request_id)
        bind_request_id(request_id)
        try:
            request = self.to_engine_request(first.start, request_id)
        except InvalidRequestError as exc:
            log.info("request_rejected", field=exc.field, code=exc.code.name)
            await context.abort(exc.code, str(exc))
        async with contextlib.aclosing(self._stream(request, request_iterator, context)) as stream:
            async for response in stream:
                yield response

    async def _stream(self, request: SequenceRequest, request_iterator: _Requests,
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[engine_pb2.EngineServiceGenerateResponse]:
        record = RequestRecord(len(request.prompt_token_ids), request.sampling.n,
                               tracing.context_from_metadata(context.invocation_metadata()))
        stream = DeltaStream(request.sampling.n, asyncio.get_running_loop())
        sink = self.request_sink(request, record, deliver=stream.deliver,
                                 fail=lambda code, message: stream.fail(
                                     RequestFailed(code, message)))
        watcher = asyncio.create_task(self._watch_client(request_iterator, request.request_id,
                                                         record))
        sink.submit()
        try:
            async for delta in stream:
                yield to_response(delta)
                if stream.ended:  # the request's last delta (its last choice's)
                    await self._after_last(delta, watcher, context)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)
        finally:
            watcher.cancel()
            sink.close(_ended_by(context, record))  # nothing if it ended

    def request_sink(self, request: SequenceRequest, record: RequestRecord, *,
                     deliver: Callable[[TokenDelta], None],
                     fail: Callable[[grpc.StatusCode, str], None],
                     on_end: Callable[[], None] | None = None) -> RequestSink:
        """The sink ``request`` is submitted with (``RequestSink.submit``): its
        deltas counted in the metrics and ``record`` (one log line,
        ``request_finished`` or ``request_rejected``, however it ends), then
        handed to ``deliver``; a refusal (INVALID_ARGUMENT, OUT_OF_RANGE,
        RESOURCE_EXHAUSTED, ALREADY_EXISTS, UNAVAILABLE) or failure (INTERNAL)
        to ``fail``."""
        return RequestSink(self._backend, request, record, self._metrics, self.replica_id,
                           deliver=deliver, fail=fail, on_end=on_end)

    async def _after_last(self, delta: TokenDelta, watcher: asyncio.Task[str | None],
                          context: grpc.aio.ServicerContext) -> None:
        if delta.finish_reason is FinishReason.ERROR:
            await context.abort(delta.status, delta.error or "the engine failed")
        finished = watcher.done() and not watcher.cancelled() and watcher.exception() is None
        violation = watcher.result() if finished else None
        if violation:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, violation)

    async def _watch_client(self, request_iterator: _Requests, request_id: str,
                            record: RequestRecord) -> str | None:
        """Reads the client's later messages: ``cancel`` cancels the sequence
        (with ``index``: that choice alone, and it reads on); a second
        ``start`` cancels it and returns the protocol violation to report.
        Notes the cause in ``record``."""
        try:
            async for message in request_iterator:
                if message.WhichOneof("action") != "cancel":
                    record.cancelled_by = "invalid_message"
                    self._backend.cancel(request_id)
                    return "start: a Generate stream carries one request; send `cancel` to end it"
                if message.cancel.HasField("index"):
                    self._backend.cancel_choice(request_id, message.cancel.index)
                    continue
                record.cancelled_by = "cancel_message"
                self._backend.cancel(request_id)
                return None
        except (grpc.RpcError, RuntimeError):  # the call ended under us
            pass
        return None

    async def Multiplex(self, request_iterator: AsyncIterator[engine_pb2.MultiplexRequest],
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[engine_pb2.MultiplexResponse]:
        """Many requests on one call (see :mod:`services.engine.multiplex`): one
        message per engine step with the updates of every request that advanced.
        Per-request statuses ride in the updates; when the caller half-closes,
        or the engine drains (SIGTERM), the call ends OK once its open requests
        have (so the drain ends with the work, not at its grace deadline; the
        router takes the replica out and opens no new call); when the caller
        drops the call, they are cancelled. A start that reuses an open
        stream_id ends the call with INVALID_ARGUMENT (and cancels its requests)."""
        call = MultiplexCall(to_request=self._request_from_start, request_sink=self.request_sink,
                             refusal=self._refusal, cancel_choice=self._backend.cancel_choice)
        drained = asyncio.create_task(_end_when_drained(call, self._stopping))
        try:
            async for response in call.server.serve(request_iterator, context,
                                                    handle=call.handle, finish=call.wait_all):
                yield response
        finally:
            drained.cancel()
            call.cancel_all()

    async def GetLoad(self, request: engine_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.GetLoadResponse:
        """Current load (served while loading and draining too)."""
        return self._backend.load().to_pb()

    async def StreamLoad(self, request: engine_pb2.StreamLoadRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[engine_pb2.StreamLoadResponse]:
        """The load at once, then on change (at most one message per
        ``min_interval_ms``, default 20) and at least every ``heartbeat_ms``
        (default 500); ends when the engine drains. Each message costs the
        engine one ``load()`` read (lock-free) per interval. INVALID_ARGUMENT
        unless 5 <= min_interval_ms <= heartbeat_ms <= 60000 (after defaults)."""
        interval_ms = request.min_interval_ms or _LOAD_INTERVAL_MS
        heartbeat_ms = request.heartbeat_ms or _LOAD_HEARTBEAT_MS
        if not _LOAD_MIN_MS <= interval_ms <= heartbeat_ms <= _LOAD_MAX_MS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"min_interval_ms and heartbeat_ms: need {_LOAD_MIN_MS} <= min_interval_ms "
                f"<= heartbeat_ms <= {_LOAD_MAX_MS} (0: the defaults, {_LOAD_INTERVAL_MS} "
                f"and {_LOAD_HEARTBEAT_MS}), got {interval_ms} and {heartbeat_ms}"))
        interval, heartbeat = interval_ms / 1000, heartbeat_ms / 1000
        loop = asyncio.get_running_loop()
        last: LoadStats | None = None
        sent_at = 0.0
        while not self._stopping.is_set():
            load = self._backend.load()
            now = loop.time()
            if load != last or now - sent_at >= heartbeat:
                last, sent_at = load, now
                yield engine_pb2.StreamLoadResponse(load=load.to_pb())
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: never swallows a cancel
                async with asyncio.timeout(interval):
                    await self._stopping.wait()

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.GetModelInfoResponse:
        """The served model's limits; UNAVAILABLE while loading."""
        if not self._ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is loading its model")
        return dataclasses.replace(
            self._backend.model_info, replica_id=self.replica_id,
            max_num_batched_tokens=self._config.step_token_budget()).to_pb()

    # ---- conversions --------------------------------------------------------------

    def to_engine_request(self, pb: engine_pb2.EngineRequest, request_id: str) -> SequenceRequest:
        """Converts ``pb``, checking each field's own form; the checks against the
        model (vocabulary, context window, KV capacity) run once, in the
        backend's ``submit`` (:mod:`services.engine.validation`). An unset
        max_tokens becomes the smallest of the server default, the cap and what
        fits in the context window (at least 1: a prompt that leaves no room is
        the backend's OUT_OF_RANGE on the prompt).

        Raises:
          InvalidRequestError: naming the first malformed field (``cache_scope``
            over :data:`~services.common.cache_scope.MAX_CACHE_SCOPE_BYTES`).
        """
        info = self._backend.model_info
        prompt = tuple(pb.prompt_token_ids)
        cap = self._config.max_tokens_cap or info.max_model_len
        room = max(info.max_model_len - len(prompt), 1)
        sampling = SamplingOptions.from_pb(
            pb.sampling, default_max_tokens=min(self._config.default_max_tokens, cap, room),
            max_tokens_cap=cap, field_prefix="sampling")
        speculative = SpeculativeOptions.from_pb(pb.speculative)
        if len(pb.tenant.encode()) > MAX_TENANT_BYTES:
            raise InvalidRequestError("tenant", f"at most {MAX_TENANT_BYTES} bytes, got "
                                      f"{len(pb.tenant.encode())}")
        return SequenceRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                               priority=Priority.from_pb(pb.priority), speculative=speculative,
                               tenant=pb.tenant, cache_scope=check_scope(pb.cache_scope))

    def _request_from_start(self, pb: engine_pb2.EngineRequest) -> SequenceRequest:
        """A Multiplex start's request (its id is in the message: one call
        carries many requests, so the call's metadata names none)."""
        if not pb.request_id:
            raise InvalidRequestError("request.request_id", "must be set on a Multiplex start")
        return self.to_engine_request(pb, pb.request_id)

    def _refusal(self) -> str | None:
        """Why no request is admitted now (draining, loading), or None."""
        if self._draining:
            return "the engine is draining; send the request to another replica"
        if not self._ready:
            return "the engine is loading its model"
        return None

    async def _check_admitting(self, context: grpc.aio.ServicerContext) -> None:
        refused = self._refusal()
        if refused is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refused)


async def _end_when_drained(call: MultiplexCall, stopping: asyncio.Event) -> None:
    """Closes the call's outbox once the engine drains and the call's open
    requests have ended (starts after the drain began are refused at once)."""
    await stopping.wait()
    await call.wait_all()
    call.outbox.close()


def _ended_by(context: grpc.aio.ServicerContext, record: RequestRecord) -> str:
    """Why a call ended before its last delta: the cancel the client sent, its
    deadline, or the client dropping it."""
    if record.cancelled_by:
        return record.cancelled_by
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return "deadline_exceeded"
    return "call_dropped"


def to_response(delta: TokenDelta) -> engine_pb2.EngineServiceGenerateResponse:
    """The protobuf message of ``delta``, with the running token counts on every
    message (the router needs ``cached_prompt_tokens`` even when it ends the
    sequence itself, on a stop string, before the engine's last message)."""
    return engine_pb2.EngineServiceGenerateResponse(
        request_id=delta.request_id, token_ids=delta.token_ids,
        finish_reason=int(delta.finish_reason), logprobs=logprobs_to_pb(delta.logprobs),
        prompt_logprobs=logprobs_to_pb(delta.prompt_logprobs),
        index=delta.index,
        usage=common_pb2.Usage(
            prompt_tokens=delta.num_prompt_tokens, completion_tokens=delta.num_generated_tokens,
            cached_prompt_tokens=delta.num_cached_tokens))


def _timings(timings: object) -> dict[str, float]:
    if timings is None:
        return {}
    return {f"{name}": round(value, 3) for name, value in vars(timings).items()}
