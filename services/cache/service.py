"""``llmesh.v1.CacheService``: the response cache for deterministic requests, and
the prefix index of the engines' KV blocks for KV-aware routing.

RPCs (the unary ones answered in well under a millisecond on loopback):

``GetCachedResponse(key)``
  ``found: true`` with the stored ``CachedResponse``, or ``found: false`` for a
  miss, an expired entry, a non-deterministic request (never cached, so never
  looked up) or a store outage. INVALID_ARGUMENT, naming the field: missing
  key, empty ``model``, empty ``prompt_token_ids`` or an id outside
  ``[0, MAX_TOKEN_ID]``, a bad ``cache_scope`` or an invalid sampling field
  (:func:`services.cache.keys.validate_key`). UNAVAILABLE while draining.

``GetCachedResponses(stream)`` (bidirectional, the router's one call per channel)
  Looks up as ``GetCachedResponse`` does, batched: each message carries the
  lookups the router queued since its previous write (at most
  :data:`MAX_LOOKUPS_PER_MESSAGE`), and the results ready at one wakeup go
  back in one message, each echoing its ``lookup_id`` (any order). A
  lookup's fault (INVALID_ARGUMENT) is its result's status. The call ends
  INVALID_ARGUMENT for an oversized message or a ``lookup_id`` still open,
  UNAVAILABLE when opened while draining, and OK once a drain begins (the
  lookups still open unanswered: the router counts them as misses). A lookup
  on an open call skips the unary call's set-up on both sides (~1 ms of the
  1.6 ms a unary miss took the router at one stream).

``PutCachedResponse(key, response, ttl_seconds)``
  ``stored: true`` once written. ``stored: false`` when the response did not
  finish normally (finish reason other than STOP or LENGTH: CANCELLED, ERROR,
  UNSPECIFIED), when it is larger than the store, or when the store is down.
  ``ttl_seconds`` 0 means the service default. INVALID_ARGUMENT as for Get,
  and for a response token id outside ``[0, MAX_TOKEN_ID]``;
  FAILED_PRECONDITION for a non-deterministic request (temperature > 0 without
  a seed). UNAVAILABLE while draining.

``PutCachedResponses(stream)`` (bidirectional, the router's one call per channel)
  Stores as ``PutCachedResponse`` does, batched: each message carries the
  stores the router queued since its previous write (at most
  :data:`MAX_STORES_PER_MESSAGE`; written together, with Redis in one
  pipeline), and one answer message carries their
  results in order, each echoing its ``store_id``. A store's fault
  (INVALID_ARGUMENT, FAILED_PRECONDITION) is that store's result status,
  not the call's: the stores batched with it come from other requests. The
  call ends INVALID_ARGUMENT for an oversized message, UNAVAILABLE when
  opened while draining, and OK once a drain begins (after answering what
  it read). One message on an open call costs both sides a fraction of a
  unary call (no call set-up, headers or call object).

``PublishKvEvents(stream)`` (bidirectional, one call per engine replica)
  The replica's KV events into the prefix index (:mod:`services.cache.kv_feed`
  says how it stays exact and what ends the call). UNAVAILABLE while draining.

``GetHistorySummary`` / ``ClaimHistorySummary`` / ``PutHistorySummary``
  Summaries of chat history for the router's history compaction, and the
  claim that makes one router write each (:mod:`services.cache.history`).
  INVALID_ARGUMENT for a bad hash or scope; UNAVAILABLE while draining.

``ScorePrefix(block_hashes)``
  For each live replica, how many leading blocks of the prompt it holds
  (replicas with none left out), best first. INVALID_ARGUMENT for a hash that
  is not 32 bytes or more than 65,536 hashes; UNAVAILABLE while draining. A
  store outage answers no scores (the router then routes by load), never an
  error.

Keys are built by :mod:`services.cache.keys`; values are the ``CachedResponse``
protobuf bytes, as the router receives them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError
from llmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2

from services.cache.history import HistorySummaries
from services.cache.keys import EntryKey, check_token_ids, entry_key
from services.cache.kv_feed import FeedError, KvEventFeed, check_hashes
from services.cache.metrics import CacheMetrics, default_metrics
from services.cache.prefix_index import MemoryPrefixIndex, PrefixIndex
from services.cache.store import ResponseStore, StoreWrite
from services.common import tracing
from services.common.grpc_util import request_id_from, status_code_of
from services.common.logging import bind_request_id
from services.common.mux import MuxServer, ProtocolViolation, never_merge
from services.common.sampling import InvalidRequestError
from services.common.wire.cache import DRAINING

log = structlog.get_logger()
T = TypeVar("T")

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name

#: Finish reasons of a response worth replaying; anything else is not stored.
CACHEABLE_FINISH_REASONS = frozenset({common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH})
#: Most hashes one ScorePrefix may carry (a 1M-token prompt at block size 16).
MAX_SCORED_BLOCKS = 65_536
#: Most stores one PutCachedResponses message may carry.
MAX_STORES_PER_MESSAGE = 4096
#: Most lookups one GetCachedResponses message may carry.
MAX_LOOKUPS_PER_MESSAGE = 4096
#: Characters of a store's request_id kept for the log (a caller's overlong id is cut).
_MAX_LOGGED_REQUEST_ID = 128


def _checked(key: cache_pb2.CacheKey, has_key: bool,
             result: cache_pb2.CachedResponseLookupResult) -> EntryKey | None:
    """The entry to look up for ``key``; None when there is none: a missing
    or bad key (its INVALID_ARGUMENT status set on ``result``), or a
    non-deterministic one (never cached: a miss). Mutates ``result``."""
    try:
        if not has_key:
            raise InvalidRequestError("key", "required")
        entry = entry_key(key)
    except InvalidRequestError as exc:
        result.status_code, result.status_message = exc.code.value[0], str(exc)
        return None
    return entry if entry.deterministic else None


def _bind_logged_id(request_id: str) -> None:
    """Binds a batched entry's request id to the log lines that follow (cut
    to 128 characters; a new one when empty)."""
    bind_request_id(request_id[:_MAX_LOGGED_REQUEST_ID] or uuid.uuid4().hex)


def _check_lookups(message: cache_pb2.GetCachedResponsesRequest, open_ids: set[int]) -> None:
    """Raises ProtocolViolation for a GetCachedResponses message over
    :data:`MAX_LOOKUPS_PER_MESSAGE` lookups, or one reusing an open id."""
    if len(message.lookups) > MAX_LOOKUPS_PER_MESSAGE:
        raise ProtocolViolation(f"lookups: at most {MAX_LOOKUPS_PER_MESSAGE} a message, "
                                f"got {len(message.lookups)}")
    ids = [lookup.lookup_id for lookup in message.lookups]
    if len(set(ids)) != len(ids) or not open_ids.isdisjoint(ids):
        raise ProtocolViolation("lookup_id: each open lookup needs an id of its own; "
                                "use a new id for each lookup")


def _lookup_results(pending: dict[int, cache_pb2.CachedResponseLookupResult]
                    ) -> tuple[cache_pb2.GetCachedResponsesResponse]:
    """The results ready at one wakeup, as one message."""
    return (cache_pb2.GetCachedResponsesResponse(results=pending.values()),)


class CacheService(cache_pb2_grpc.CacheServiceServicer):
    """The cache servicer, run by :func:`services.common.server.run_service`.

    Args:
      store: where responses live (:class:`~services.cache.store.MemoryStore`
        or :class:`~services.cache.store.RedisStore`); the service owns it and
        closes it in :meth:`close`.
      default_ttl_seconds: lifetime of an entry stored with ``ttl_seconds: 0``.
      metrics: where to count (default: the process registry).
    """

    service_names = (SERVICE_NAME,)

    def __init__(self, store: ResponseStore, *, default_ttl_seconds: int = 3600,
                 metrics: CacheMetrics | None = None, index: PrefixIndex | None = None) -> None:
        if default_ttl_seconds <= 0:
            raise ValueError(f"default_ttl_seconds must be > 0, got {default_ttl_seconds}")
        self.store = store
        self.default_ttl_seconds = default_ttl_seconds
        self._metrics = metrics or default_metrics()
        self.index = index if index is not None else MemoryPrefixIndex(metrics=self._metrics)
        self._get_duration = self._metrics.request_duration.labels("GetCachedResponse")
        self._put_duration = self._metrics.request_duration.labels("PutCachedResponse")
        self._gets_duration = self._metrics.request_duration.labels("GetCachedResponses")
        self._puts_duration = self._metrics.request_duration.labels("PutCachedResponses")
        #: Open PutCachedResponses and GetCachedResponses calls (ended by the drain).
        self._mux_calls: set[MuxServer[int, Any]] = set()
        self._feed = KvEventFeed(self.index, self._metrics)
        self.history = HistorySummaries(store, default_ttl_seconds)
        self._draining = False

    # Service protocol ---------------------------------------------------------

    def register(self, server: grpc.aio.Server) -> None:
        """Adds the servicer to ``server``."""
        cache_pb2_grpc.add_CacheServiceServicer_to_server(self, server)

    async def start(self) -> None:
        """Connects the store.

        Raises:
          StoreUnavailableError: the Redis URL given does not answer.
        """
        await self.store.start()
        await self.index.start()
        log.info("cache_ready", backend=self.store.backend, index_backend=self.index.backend,
                 default_ttl_seconds=self.default_ttl_seconds)

    async def drain(self) -> None:
        """New calls get UNAVAILABLE from now on; open PutCachedResponses calls
        end once what they read is answered, open GetCachedResponses calls once
        the results ready are written (the drain does not wait for the router
        to hang up)."""
        self._draining = True
        for call in self._mux_calls:
            call.outbox.close()

    async def close(self) -> None:
        """Closes the store and the index."""
        await self.store.close()
        await self.index.close()

    # RPCs -----------------------------------------------------------------------

    async def _open(self, context: grpc.aio.ServicerContext) -> None:
        """Binds the call's request id to the logs; aborts UNAVAILABLE while draining."""
        bind_request_id(request_id_from(context))
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)

    async def GetCachedResponse(  # noqa: N802 - gRPC method name
        self, request: cache_pb2.GetCachedResponseRequest, context: grpc.aio.ServicerContext,
    ) -> cache_pb2.GetCachedResponseResponse:
        """The cached response of ``request.key`` (``found`` false on a miss), in
        the span ``llmesh.cache.get`` when the caller's metadata carries a trace."""
        parent = tracing.context_from_metadata(context.invocation_metadata())
        with tracing.span("llmesh.cache.get", parent) as span:
            reply = await self._get(request, context)
            if span is not None:
                span.set_attribute("llmesh.cache.hit", reply.found)
            return reply

    async def _get(self, request: cache_pb2.GetCachedResponseRequest,
                   context: grpc.aio.ServicerContext) -> cache_pb2.GetCachedResponseResponse:
        started = time.perf_counter()
        try:
            await self._open(context)
            result = await self._lookup(request.key, request.HasField("key"))
            if result.status_code:
                await context.abort(status_code_of(result.status_code), result.status_message)
            if not result.found:
                return cache_pb2.GetCachedResponseResponse(found=False)
            return cache_pb2.GetCachedResponseResponse(found=True, response=result.response)
        finally:
            self._get_duration.observe(time.perf_counter() - started)

    async def _lookup(self, key: cache_pb2.CacheKey, has_key: bool,
                      lookup_id: int = 0) -> cache_pb2.CachedResponseLookupResult:
        """One lookup's result: ``found`` with the stored response, a miss
        (also for a non-deterministic key, an expired or unreadable entry, a
        store outage), or the status the unary call answers (INVALID_ARGUMENT
        for a missing or bad key). Never raises for a caller's input."""
        result = cache_pb2.CachedResponseLookupResult(lookup_id=lookup_id)
        entry = _checked(key, has_key, result)
        if entry is None:
            return result
        self._metrics.queries.inc()
        return self._answered(result, entry, await self.store.get(entry.store_key))

    async def _lookups(self, lookups: Sequence[cache_pb2.CachedResponseLookup]
                       ) -> list[cache_pb2.CachedResponseLookupResult]:
        """The lookups of one GetCachedResponses message, as :meth:`_lookup`
        answers each, with one store round trip for all (Redis: one
        ``MGET``); each in its span ``llmesh.cache.get`` when it carries a
        trace, its log lines bound to its request id."""
        results = [cache_pb2.CachedResponseLookupResult(lookup_id=lookup.lookup_id)
                   for lookup in lookups]
        with contextlib.ExitStack() as stack:
            spans = [stack.enter_context(tracing.span(
                "llmesh.cache.get", tracing.context_of(lookup.traceparent)))
                for lookup in lookups]
            entries = [_checked(lookup.key, lookup.HasField("key"), result)
                       for lookup, result in zip(lookups, results)]
            wanted = [i for i, entry in enumerate(entries) if entry is not None]
            if wanted:
                self._metrics.queries.inc(len(wanted))
                values = await self.store.get_many(
                    [entries[i].store_key for i in wanted])  # type: ignore[union-attr]
                for i, value in zip(wanted, values):
                    _bind_logged_id(lookups[i].request_id)
                    self._answered(results[i], entries[i], value)  # type: ignore[arg-type]
            for span, result in zip(spans, results):
                if span is not None:
                    span.set_attribute("llmesh.cache.hit", result.found)
        return results

    def _answered(self, result: cache_pb2.CachedResponseLookupResult, entry: EntryKey,
                  value: bytes | None) -> cache_pb2.CachedResponseLookupResult:
        """``result`` filled from the store's ``value`` of ``entry`` (None: a
        miss; an unreadable value: a miss, logged). Mutates ``result``."""
        if value is None:
            return result
        try:
            result.response.ParseFromString(value)
        except DecodeError:
            log.warning("cache_entry_unreadable", key=entry.store_key, action="answered miss")
            result.ClearField("response")
            return result
        result.found = True
        self._metrics.hits.inc()
        log.debug("cache_hit", tokens=len(result.response.token_ids))
        return result

    async def GetCachedResponses(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[cache_pb2.GetCachedResponsesRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[cache_pb2.GetCachedResponsesResponse]:
        """Lookups on one long-lived call (the stream kit's server end): each
        message's lookups answered as the unary call answers them, with one
        store round trip for all (Redis ``MGET``), in a task of the message's
        own (a slow store holds up no later message), the
        results ready at one wakeup written as one message. A lookup's fault
        is its result's status; the call ends INVALID_ARGUMENT for a message
        over :data:`MAX_LOOKUPS_PER_MESSAGE` lookups or a ``lookup_id`` still
        open, UNAVAILABLE when it opens while draining, and OK when a drain
        begins after it opened (lookups still open are not answered)."""
        await self._open(context)
        server: MuxServer[int, cache_pb2.CachedResponseLookupResult] = MuxServer(
            merge=never_merge, pack=_lookup_results)
        open_ids: set[int] = set()
        tasks: set[asyncio.Task[None]] = set()

        async def answer(lookups: Sequence[cache_pb2.CachedResponseLookup]) -> None:
            started = time.perf_counter()
            if len(lookups) == 1:
                results = [await self._lookup_logged(lookups[0])]
            else:
                results = await self._lookups(lookups)
            for result in results:
                open_ids.discard(result.lookup_id)
                server.outbox.put(result.lookup_id, result)
            self._gets_duration.observe(time.perf_counter() - started)

        async def handle(message: cache_pb2.GetCachedResponsesRequest) -> None:
            _check_lookups(message, open_ids)
            open_ids.update(lookup.lookup_id for lookup in message.lookups)
            task = asyncio.create_task(answer(message.lookups))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def finish() -> None:  # the caller half-closed: answer what it asked
            while tasks:
                await asyncio.wait(list(tasks))

        try:
            async for reply in self._serve_mux(server, request_iterator, context,
                                               handle=handle, finish=finish):
                yield reply
        finally:
            for task in list(tasks):
                task.cancel()

    async def _serve_mux(self, server: MuxServer[int, Any], requests: AsyncIterator[Any],
                         context: grpc.aio.ServicerContext, *,
                         handle: Callable[[Any], Awaitable[None]],
                         finish: Callable[[], Awaitable[None]]) -> AsyncIterator[Any]:
        """``server.serve``'s messages, the call registered meanwhile for the
        drain (which closes its outbox)."""
        self._mux_calls.add(server)
        try:
            async for message in server.serve(requests, context, handle=handle, finish=finish):
                yield message
        finally:
            self._mux_calls.discard(server)

    async def _lookup_logged(self, lookup: cache_pb2.CachedResponseLookup
                             ) -> cache_pb2.CachedResponseLookupResult:
        """:meth:`_lookup` of one lookup of a GetCachedResponses message, its
        log lines bound to its request id (cut to 128 characters), in the span
        ``llmesh.cache.get`` when it carries a trace."""
        _bind_logged_id(lookup.request_id)
        with tracing.span("llmesh.cache.get", tracing.context_of(lookup.traceparent)) as span:
            result = await self._lookup(lookup.key, lookup.HasField("key"), lookup.lookup_id)
            if span is not None:
                span.set_attribute("llmesh.cache.hit", result.found)
            return result

    async def PutCachedResponse(  # noqa: N802 - gRPC method name
        self, request: cache_pb2.PutCachedResponseRequest, context: grpc.aio.ServicerContext,
    ) -> cache_pb2.PutCachedResponseResponse:
        started = time.perf_counter()
        try:
            await self._open(context)
            result = await self._put(request)
            if result.status_code:
                await context.abort(status_code_of(result.status_code), result.status_message)
            return cache_pb2.PutCachedResponseResponse(stored=result.stored)
        finally:
            self._put_duration.observe(time.perf_counter() - started)

    async def _put(self, request: cache_pb2.PutCachedResponseRequest
                   ) -> cache_pb2.CachedResponseStoreResult:
        """Checks and stores one response: its result (``stored``, or the status
        the unary call answers: see :meth:`_checked_store`). Never raises for a
        caller's input."""
        result, write = self._checked_store(request)
        if write is not None:
            self._stored(result, request, await self.store.put(*write))
        return result

    def _checked_store(self, request: cache_pb2.PutCachedResponseRequest, store_id: int = 0,
                       ) -> tuple[cache_pb2.CachedResponseStoreResult, StoreWrite | None]:
        """One store checked: its result so far, and the write to make (None:
        nothing to write). The result carries the status the unary call
        answers: INVALID_ARGUMENT for a bad key or a response token id outside
        ``[0, MAX_TOKEN_ID]``, FAILED_PRECONDITION for a non-deterministic key;
        no write either for a response that did not finish normally."""
        result = cache_pb2.CachedResponseStoreResult(store_id=store_id)
        try:
            if not request.HasField("key"):
                raise InvalidRequestError("key", "required")
            entry = entry_key(request.key)
            check_token_ids(request.response.token_ids, "response.token_ids", allow_empty=True)
        except InvalidRequestError as exc:
            result.status_code, result.status_message = exc.code.value[0], str(exc)
            return result, None
        if not entry.deterministic:
            result.status_code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
            result.status_message = ("key.sampling: only deterministic requests are cached "
                                     "(temperature 0 or an explicit seed)")
            return result, None
        if request.response.finish_reason not in CACHEABLE_FINISH_REASONS:
            return result, None
        ttl_seconds = request.ttl_seconds or self.default_ttl_seconds
        return result, StoreWrite(entry.store_key, request.response.SerializeToString(),
                                  ttl_seconds)

    def _stored(self, result: cache_pb2.CachedResponseStoreResult,
                request: cache_pb2.PutCachedResponseRequest, stored: bool) -> None:
        """Records a write's outcome in ``result``, the metric and the log."""
        result.stored = stored
        if stored:
            self._metrics.stores.inc()
        log.debug("cache_put", stored=stored, tokens=len(request.response.token_ids))

    async def PutCachedResponses(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[cache_pb2.PutCachedResponsesRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[cache_pb2.PutCachedResponsesResponse]:
        """Stores on one long-lived call (the stream kit's server end): each
        message's stores checked and stored as the unary call does, their
        results answered in one message. An entry's fault is its result's
        status; the call ends INVALID_ARGUMENT for a message over
        :data:`MAX_STORES_PER_MESSAGE` entries, UNAVAILABLE when it opens
        while draining, and OK when a drain begins after it opened (once what
        it read is answered)."""
        await self._open(context)
        server: MuxServer[int, cache_pb2.PutCachedResponsesResponse] = MuxServer(
            merge=never_merge, pack=dict.values)
        batches = itertools.count()  # outbox keys: one answer per request message

        async def handle(message: cache_pb2.PutCachedResponsesRequest) -> None:
            started = time.perf_counter()
            if len(message.stores) > MAX_STORES_PER_MESSAGE:
                raise ProtocolViolation(f"stores: at most {MAX_STORES_PER_MESSAGE} a message, "
                                        f"got {len(message.stores)}")
            results = await self._put_batch(message.stores)
            server.outbox.put(next(batches),
                              cache_pb2.PutCachedResponsesResponse(results=results))
            self._puts_duration.observe(time.perf_counter() - started)

        async def finish() -> None:  # the caller half-closed: everything is answered
            return

        async for answer in self._serve_mux(server, request_iterator, context, handle=handle,
                                            finish=finish):
            yield answer

    async def _put_batch(self, stores: Sequence[cache_pb2.CachedResponseStore]
                         ) -> list[cache_pb2.CachedResponseStoreResult]:
        """The stores of one PutCachedResponses message, checked one by one as
        the unary call checks them and written together
        (:meth:`~services.cache.store.ResponseStore.put_many`: one Redis
        pipeline), their results in order; each store's log line is bound to
        its request id (cut to 128 characters)."""
        checked = [self._checked_store(store.put, store.store_id) for store in stores]
        writes = [write for _, write in checked if write is not None]
        outcomes = iter(await self.store.put_many(writes) if writes else ())
        for store, (result, write) in zip(stores, checked, strict=True):
            if write is not None:
                _bind_logged_id(store.request_id)
                self._stored(result, store.put, next(outcomes))
        return [result for result, _ in checked]

    async def PublishKvEvents(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[cache_pb2.PublishKvEventsRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[cache_pb2.PublishKvEventsResponse]:
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        try:
            async for response in self._feed.run(request_iterator):
                yield response
        except FeedError as err:
            await context.abort(err.code, str(err))

    async def ScorePrefix(  # noqa: N802 - gRPC method name
        self, request: cache_pb2.ScorePrefixRequest, context: grpc.aio.ServicerContext,
    ) -> cache_pb2.ScorePrefixResponse:
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        hashes = request.block_hashes
        if len(hashes) > MAX_SCORED_BLOCKS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block_hashes: at most {MAX_SCORED_BLOCKS}, got {len(hashes)}")
        try:
            check_hashes(hashes, "block_hashes")
        except FeedError as err:
            await context.abort(err.code, str(err))
        matches = await self.index.match(hashes) if hashes else {}  # observes the latency
        return cache_pb2.ScorePrefixResponse(scores=[
            cache_pb2.PrefixScore(replica_id=replica, matched_blocks=found.blocks,
                                  offloaded_blocks=found.offloaded)
            for replica, found in sorted(matches.items(), key=lambda item: -item[1].blocks)])

    async def _history_call(self, call: Callable[[], Awaitable[T]],
                            context: grpc.aio.ServicerContext) -> T:
        """``call()`` unless draining; InvalidRequestError aborts with its code."""
        await self._open(context)
        try:
            return await call()
        except InvalidRequestError as exc:
            await context.abort(exc.code, str(exc))
            raise  # unreachable: abort raises

    async def GetHistorySummary(  # noqa: N802 - gRPC method name
        self, request: cache_pb2.GetHistorySummaryRequest, context: grpc.aio.ServicerContext,
    ) -> cache_pb2.GetHistorySummaryResponse:
        return await self._history_call(lambda: self.history.get(request), context)

    async def ClaimHistorySummary(  # noqa: N802 - gRPC method name
        self, request: cache_pb2.ClaimHistorySummaryRequest, context: grpc.aio.ServicerContext,
    ) -> cache_pb2.ClaimHistorySummaryResponse:
        claimed = await self._history_call(lambda: self.history.claim(request), context)
        return cache_pb2.ClaimHistorySummaryResponse(claimed=claimed)

    async def PutHistorySummary(  # noqa: N802 - gRPC method name
        self, request: cache_pb2.PutHistorySummaryRequest, context: grpc.aio.ServicerContext,
    ) -> cache_pb2.PutHistorySummaryResponse:
        stored = await self._history_call(lambda: self.history.put(request), context)
        return cache_pb2.PutHistorySummaryResponse(stored=stored)
