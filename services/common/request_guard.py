"""Requests whose bytes do not parse end INVALID_ARGUMENT, in every service.

gRPC Python deserializes a request before any handler runs; protobuf refuses
bytes that are not the message (a ``string`` field holding invalid UTF-8,
proto3's rule; a truncated or corrupt wire format) with ``DecodeError``. Left
alone, grpc turns that into UNKNOWN "Unexpected <class DecodeError>" and logs a
traceback per call: a cheap way to flood a service's log, and a status that
tells the client nothing. :class:`RequestGuard`, a server interceptor the
server kit installs on every ``grpc.aio`` server (:func:`services.common.server.
make_server`), replaces each method handler so that:

* its request deserializer returns an :class:`UnparsableRequest` marker
  instead of raising (with a diagnosis naming the field, e.g.
  ``chat.messages[0].content``, where the bad bytes are a string's);
* a unary request that is a marker ends the call INVALID_ARGUMENT with the
  marker's message before the handler runs;
* a marker read from a request stream (each message of a bidi or
  client stream is checked as the handler reads it from its iterator)
  cancels the handler as a client that went away would (its ``finally``
  blocks release what it holds), then ends the call INVALID_ARGUMENT;
* the refusal is logged as one ``request_unparsable`` warning per
  :data:`LOG_INTERVAL_SECONDS` at most (with the number left out since the last
  line), and reported to ``on_refused(method)`` (the router counts it in
  ``requests_total``).

Handlers must read request streams through their iterator (every llmesh
handler does): ``context.read()`` would hand them the marker itself. Only
``async`` handlers are guarded; a sync one is left as it is. A guarded
async-generator handler runs as a coroutine that writes each response with
``context.write`` (the calls grpc's own loop would make), so that the cancel
of a stream refusal always unwinds through the guard.

The status a client sees (``details``)::

  llmesh.v1.GenerateRequest: the request could not be parsed: field `prompt`
  holds invalid UTF-8 (protobuf string fields must be UTF-8 text; send
  arbitrary bytes in a bytes field)

Over HTTP/JSON, Envoy's transcoder refuses the same input with 400 before it
reaches a service.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from services.common.active_calls import ActiveCalls

log = structlog.get_logger()

#: The most often one service logs an unparsable request (seconds between lines).
LOG_INTERVAL_SECONDS = 10.0

#: Fields the diagnosis reads at most before it gives up naming the field.
DIAGNOSIS_FIELD_BUDGET = 10_000

@dataclass(frozen=True)
class UnparsableRequest:
    """What a guarded deserializer returns for bytes that do not parse.

    Attributes:
      message_type: full protobuf name, e.g. ``llmesh.v1.GenerateRequest``.
      field: path of the string field holding invalid UTF-8
        (``chat.messages[0].content``), or None when no string is to blame.
    """

    message_type: str
    field: str | None

    @property
    def message(self) -> str:
        """The status details the client gets."""
        head = f"{self.message_type}: the request could not be parsed: "
        if self.field is not None:
            return (head + f"field `{self.field}` holds invalid UTF-8 (protobuf string fields "
                    "must be UTF-8 text; send arbitrary bytes in a bytes field)")
        return head + ("the bytes are not a valid protobuf encoding of this message "
                       "(truncated or corrupt wire format, or a string field holds "
                       "invalid UTF-8)")


# ---------------------------------------------------------------- diagnosis


class _Unreadable(Exception):
    """The wire format ends or breaks where the diagnosis reads it."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    """Reads a base-128 varint at ``pos``; returns (value, next position)."""
    value = shift = 0
    while pos < len(data) and shift < 70:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Unreadable


def _bad_string_field(data: memoryview, descriptor: Descriptor, prefix: str,
                      budget: list[int]) -> str | None:
    """The path of the first string field of ``descriptor`` in ``data`` (nested
    messages included) whose bytes are not UTF-8, or None.

    Walks the wire format (https://protobuf.dev/programming-guides/encoding/):
    tag varint, then a varint (type 0), 8 bytes (1), a length and that many
    bytes (2) or 4 bytes (5). Raises :class:`_Unreadable` on anything else or
    past ``budget[0]`` fields.
    """
    pos, seen = 0, {}
    while pos < len(data):
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unreadable
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
            continue
        if wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            continue
        if wire_type != 2:
            raise _Unreadable
        length, pos = _varint(data, pos)
        chunk, pos = data[pos:pos + length], pos + length
        if pos > len(data):
            raise _Unreadable
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        index = seen[number] = seen.get(number, -1) + 1
        path = prefix + field.name + (f"[{index}]" if field.is_repeated else "")
        found = _bad_string_in(chunk, field, path, budget)
        if found is not None:
            return found
    return None


def _bad_string_in(chunk: memoryview, field: FieldDescriptor, path: str,
                   budget: list[int]) -> str | None:
    """``path`` if ``chunk`` is a string field's bytes and not UTF-8; for a
    message field, the bad string's path inside it; else None."""
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            str(chunk, "utf-8")
        except UnicodeDecodeError:
            return path
        return None
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _bad_string_field(chunk, field.message_type, path + ".", budget)
    return None


def diagnose(data: bytes, descriptor: Descriptor | None, fallback_type: str = "the request",
             ) -> UnparsableRequest:
    """Why ``data`` does not parse as ``descriptor``'s message (never raises)."""
    if descriptor is None:
        return UnparsableRequest(fallback_type, None)
    try:
        field = _bad_string_field(memoryview(data), descriptor, "", [DIAGNOSIS_FIELD_BUDGET])
    except Exception:  # noqa: BLE001 - _Unreadable, or anything: the refusal must not fail
        field = None
    return UnparsableRequest(descriptor.full_name, field)


def guarded_deserializer(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserializer`` (a generated ``Message.FromString``) returning an
    :class:`UnparsableRequest` instead of raising ``DecodeError``."""
    message_class = getattr(deserializer, "__self__", None)
    descriptor = getattr(message_class, "DESCRIPTOR", None)
    if not isinstance(descriptor, Descriptor):
        descriptor = None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return diagnose(data, descriptor)

    return deserialize


# ---------------------------------------------------------------- refusals


class LogThrottle:
    """Lets one line through per ``interval_s`` seconds and counts the rest.

    Not thread-safe; one event loop uses it.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next_at = float("-inf")
        self._held_back = 0

    def admit(self) -> int | None:
        """The number of lines held back since the last one if this one may be
        logged now, else None (and it is counted)."""
        now = self._clock()
        if now < self._next_at:
            self._held_back += 1
            return None
        held_back, self._held_back = self._held_back, 0
        self._next_at = now + self.interval_s
        return held_back


class _GuardedRequests:
    """A request stream that stops the call at the first unparsable message.

    The call task (the one running the handler) is cancelled, or, when it is the
    reader, gets ``CancelledError`` from its read: either way the handler
    unwinds as for a client that went away, and :class:`RequestGuard` then
    ends the call with the refusal.
    """

    def __init__(self, requests: AsyncIterator[Any], call_task: asyncio.Task[Any] | None) -> None:
        self._requests = requests
        self._call_task = call_task
        self.refused: UnparsableRequest | None = None
        self.cancelled_call = False

    def __aiter__(self) -> _GuardedRequests:
        return self

    async def __anext__(self) -> Any:
        request = await self._requests.__anext__()
        if not isinstance(request, UnparsableRequest):
            return request
        self.refused = request
        call = self._call_task
        if call is not None and call is not asyncio.current_task() and not call.done():
            self.cancelled_call = True
            call.cancel()
        raise asyncio.CancelledError


async def _run_to_end(behavior: Callable[..., Any], request: Any,
                      context: grpc.aio.ServicerContext) -> Any:
    """Runs an async handler in this task: its result, or (for an async
    generator) None after writing each response with ``context.write``."""
    if inspect.isasyncgenfunction(behavior):
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                await context.write(response)
        return None
    return await behavior(request, context)


class RequestGuard(grpc.aio.ServerInterceptor):
    """The server interceptor that refuses unparsable requests (see the module doc)."""

    def __init__(self, on_refused: Callable[[str], None] | None = None, *,
                 log_interval_s: float = LOG_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 calls: ActiveCalls | None = None) -> None:
        """Args:
          on_refused: called with the full method name
            (``/llmesh.v1.GenerationService/Generate``) for each refusal.
          calls: counts each guarded call while its handler runs (the server
            kit's drain waits for them: :mod:`services.common.active_calls`).
          log_interval_s: the least seconds between two ``request_unparsable`` lines.
          clock: monotonic seconds (tests pass their own).
        """
        self._on_refused = on_refused
        self._calls = calls or ActiveCalls()
        self._throttle = LogThrottle(log_interval_s, clock)
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = self._guard(method, handler)
        self._handlers[method] = (handler, guarded)
        return guarded

    def _guard(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with a guarded deserializer and behaviour (async handlers only)."""
        request_kind = "stream" if handler.request_streaming else "unary"
        response_kind = "stream" if handler.response_streaming else "unary"
        kind = f"{request_kind}_{response_kind}"  # e.g. unary_stream
        behavior = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler
        wrap = self._guard_stream if handler.request_streaming else self._guard_unary
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(wrap(method, behavior), request_deserializer=guarded_deserializer(
            handler.request_deserializer), response_serializer=handler.response_serializer)

    def _guard_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, UnparsableRequest):
                await self._refuse(method, request, context)
            with self._calls.track(method):
                return await _run_to_end(behavior, request, context)
        return guarded

    def _guard_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            stream = _GuardedRequests(requests, asyncio.current_task())
            try:
                with self._calls.track(method):
                    result = await _run_to_end(behavior, stream, context)
            except asyncio.CancelledError:
                if stream.refused is None:
                    raise  # the client went away, or the server stops
                result = None
            if stream.refused is not None:
                if stream.cancelled_call:
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
                await self._refuse(method, stream.refused, context)
            return result
        return guarded

    async def _refuse(self, method: str, request: UnparsableRequest,
                      context: grpc.aio.ServicerContext) -> None:
        """Logs (throttled), reports and ends the call INVALID_ARGUMENT (raises
        ``grpc.aio.AbortError``, as ``context.abort`` does)."""
        held_back = self._throttle.admit()
        if held_back is not None:
            log.warning("request_unparsable", method=method, message_type=request.message_type,
                        field=request.field, not_logged_since_last=held_back,
                        log_interval_s=self._throttle.interval_s)
        if self._on_refused is not None:
            self._on_refused(method)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


__all__ = ["LOG_INTERVAL_SECONDS", "LogThrottle", "RequestGuard", "UnparsableRequest",
           "diagnose", "guarded_deserializer"]
