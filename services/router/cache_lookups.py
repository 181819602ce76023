"""The router's response-cache lookups on one long-lived call
(``CacheService.GetCachedResponses``), on the first token's path of every
shareable request.

A lookup on an open call is one message each way (the stream kit's
:class:`~services.common.mux.MuxClient` writes it at once, batched with
the lookups queued beside it); a unary ``GetCachedResponse`` also sets up a
call on both sides: at one stream the unary miss took the router 1.6 ms from
lookup to answer, of which ~1 ms before the cache's handler ran (stop 45's
timeline). Each lookup is matched to its result by ``lookup_id``.

Failures are misses, never a request's error:

* the call breaks (the cache restarted, died, drains, or is older than the
  call): each lookup open on it is asked again as a unary
  ``GetCachedResponse`` within what is left of its budget (a miss only when
  that fails too, logged ``cache_get_failed``); for a backoff after it
  (50 ms, doubling to 2 s, back to none after a lookup is answered on a
  call) lookups are unary calls, as before the stream, then the next lookup
  opens a new call. The status a break reads with is not enough to tell an
  older cache: a first write racing its UNIMPLEMENTED ends the call
  "INTERNAL: Internal error from Core" (QA: 10 of 30 fresh clients' first
  lookups missed so);
* no result before the lookup's budget (the cache's budget, bounded by the
  client's deadline): a miss (``cache_get_failed``), the result dropped when
  it comes;
* a result with a status (INVALID_ARGUMENT: a router bug): a miss, logged
  ``cache_get_failed``;
* a cache older than ``GetCachedResponses`` (the call ends UNIMPLEMENTED, e.g.
  mid-way through a rolling upgrade): each lookup is unary for
  :data:`~services.router.cache_stores.UNARY_FOR_S` (logged
  ``cache_get_unary``), then the next lookup tries a call again (the cache
  may have been upgraded).

Threading: one event loop (the router's).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence

import grpc
import structlog

from llmesh.v1 import cache_pb2, cache_pb2_grpc
from services.common.grpc_util import request_id_metadata, status_code_of
from services.common.mux import MuxClient
from services.common.tracing import TRACEPARENT
from services.common.wire.cache import CachedResponse, CacheKey
from services.router import cache_stores
from services.router.cache_stores import call_error, next_backoff, unimplemented

log = structlog.get_logger()

#: Lookups one message may carry (the cache's ``MAX_LOOKUPS_PER_MESSAGE``).
MAX_LOOKUPS_PER_MESSAGE = 4096

_Lookup = cache_pb2.CachedResponseLookup
_Result = cache_pb2.CachedResponseLookupResult
_LookupMux = MuxClient[_Lookup, _Result]


class _Answer:
    """One lookup's receiving end on the call (a mux :class:`Receiver`): its
    result, or the call's failure."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[_Result]) -> None:
        self.future = future

    def deliver(self, update: _Result) -> bool:
        if not self.future.done():
            self.future.set_result(update)
        return True

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def _pack(lookups: list[_Lookup]) -> Iterable[cache_pb2.GetCachedResponsesRequest]:
    """Everything queued since the previous write, at most
    :data:`MAX_LOOKUPS_PER_MESSAGE` lookups a message."""
    for first in range(0, len(lookups), MAX_LOOKUPS_PER_MESSAGE):
        yield cache_pb2.GetCachedResponsesRequest(
            lookups=lookups[first:first + MAX_LOOKUPS_PER_MESSAGE])


def _unpack(answer: cache_pb2.GetCachedResponsesResponse) -> Iterable[tuple[int, _Result]]:
    return ((result.lookup_id, result) for result in answer.results)


class LookupStream:
    """The ``GetCachedResponses`` call of one router→cache channel, opened on
    the first lookup and again (after a backoff) when it breaks.

    Args:
      stub: the cache service's stub on the channel.
      target: the cache's ``host:port`` (log lines).
    """

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, target: str) -> None:
        self._stub = stub
        self.target = target
        self._ids = itertools.count(1)
        self._mux: _LookupMux | None = None
        #: ``loop.time()`` until which lookups are unary (the call broke, or
        #: the cache has no GetCachedResponses).
        self._unary_until = 0.0
        self._backoff_s = 0.0
        self._closed = False

    async def get(self, key: CacheKey, *, request_id: str, timeout: float,
                  trace_metadata: Sequence[tuple[str, str]] = ()) -> CachedResponse | None:
        """The cached response for ``key``, or None: a miss, or any failure
        (logged) within ``timeout`` seconds (> 0). ``trace_metadata``: the
        caller's span's W3C trace context
        (:func:`services.common.tracing.metadata_of`). Never raises but
        CancelledError."""
        mux = self._call()
        if mux is None:
            return await self._get_unary(key, request_id, timeout, trace_metadata)
        lookup = _Lookup(lookup_id=next(self._ids), key=key.to_pb(), request_id=request_id,
                         traceparent=dict(trace_metadata).get(TRACEPARENT, ""))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_Result] = loop.create_future()
        until = loop.time() + timeout
        mux.open(lookup.lookup_id, _Answer(future), lookup)
        try:
            await mux.flush()  # on the first token's path: it leaves now
            async with asyncio.timeout_at(until):
                result = await future
        except TimeoutError:
            log.warning("cache_get_failed", target=self.target, code="DEADLINE_EXCEEDED",
                        details=f"no result within {timeout * 1e3:.0f} ms")
            return None
        except ConnectionError:  # the call broke (logged by the kit): asked unary
            if not self._closed and (left := until - loop.time()) > 0:
                return await self._get_unary(key, request_id, left, trace_metadata)
            return None
        finally:
            mux.forget(lookup.lookup_id)
        return self._response_of(result)

    def _response_of(self, result: _Result) -> CachedResponse | None:
        """A result as the lookup's answer (None: a miss, or a refused lookup)."""
        self._backoff_s = 0.0
        if result.status_code:
            log.warning("cache_get_failed", target=self.target,
                        code=status_code_of(result.status_code).name,
                        details=result.status_message)
            return None
        return CachedResponse.from_pb(result.response) if result.found else None

    async def _get_unary(self, key: CacheKey, request_id: str, timeout: float,
                         trace_metadata: Sequence[tuple[str, str]]) -> CachedResponse | None:
        """``key``'s lookup as a unary ``GetCachedResponse`` (the call is down,
        or the cache has no stream)."""
        try:
            reply = await self._stub.GetCachedResponse(
                cache_pb2.GetCachedResponseRequest(key=key.to_pb()), timeout=timeout,
                metadata=(*request_id_metadata(request_id), *trace_metadata))
        except grpc.aio.AioRpcError as err:
            log.warning("cache_get_failed", target=self.target, code=err.code().name,
                        details=err.details())
            return None
        return CachedResponse.from_pb(reply.response) if reply.found else None

    def _call(self) -> _LookupMux | None:
        """The open call; a new one when there is none and no backoff runs;
        None while one does, or while lookups are unary (an older cache)."""
        if self._mux is not None and self._mux.failed is None:
            return self._mux
        if self._closed:
            return None
        if asyncio.get_running_loop().time() < self._unary_until:
            return None
        self._mux = MuxClient(
            self._stub.GetCachedResponses(), pack=_pack, unpack=_unpack,
            make_error=call_error(self.target), service="cache", target=self.target,
            on_failed=self._failed)
        return self._mux

    def _failed(self, why: str) -> None:
        """The call broke: its lookups are asked unary (:meth:`get`, after
        this); lookups are unary for the backoff, or for
        :data:`~services.router.cache_stores.UNARY_FOR_S` when the cache has
        no GetCachedResponses."""
        if self._closed:
            return
        now = asyncio.get_running_loop().time()
        if unimplemented(why):
            log.warning("cache_get_unary", target=self.target, why=why,
                        retry_in_s=cache_stores.UNARY_FOR_S)
            self._unary_until = now + cache_stores.UNARY_FOR_S
            return
        log.info("cache_lookup_call_ended", target=self.target, why=why)
        self._backoff_s = next_backoff(self._backoff_s)
        self._unary_until = now + self._backoff_s

    @property
    def open_lookups(self) -> int:
        """Lookups waiting for their result on the call."""
        return self._mux.open_streams if self._mux is not None else 0

    async def close(self) -> None:
        """Ends the call; lookups still waiting miss."""
        self._closed = True
        if self._mux is not None:
            self._mux.fail("the router closed the call")
            await self._mux.close()

