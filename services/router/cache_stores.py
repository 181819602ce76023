"""The router's response-cache stores on one long-lived call
(``CacheService.PutCachedResponses``), off the per-request RPC path.

A store is queued, not called: :meth:`StoreStream.put` gives a future at once
(True once the cache kept the response; False when it did not, or the store
was lost), and the stream kit's writer (:class:`~services.common.mux.MuxClient`)
sends everything queued since its previous write as one message; the cache
answers each message with one message of results, each matched to its store
by ``store_id``. A store on an open stream costs the router and the cache a
fraction of a unary ``PutCachedResponse`` (no call set-up, headers, call
object or task per store; docs/architecture.md "What the mesh costs").

Failures never reach a request:

* the call breaks (the cache restarted, died, or drains): the stores in
  flight on it resolve False (one ``cache_put_failed`` warning, counted as
  ``failed``); the next call opens after a backoff (50 ms, doubling to 2 s,
  back to none after a store is answered), and stores made meanwhile wait
  in a backlog for it. A new call waits for the channel to connect
  (``wait_for_ready``), so the stores made while the cache is down land
  when it is back;
* at most ``max_pending`` stores wait (in the backlog or unanswered on the
  call): more are dropped at once (their future False, counted ``dropped``),
  so a cache that is down or stalled costs bounded memory;
* a store the cache refuses (its result carries INVALID_ARGUMENT or
  FAILED_PRECONDITION: a router bug) resolves False, logged
  ``cache_put_refused`` and counted ``refused``;
* a cache older than ``PutCachedResponses`` (the call ends UNIMPLEMENTED,
  e.g. mid-way through a rolling upgrade): the stores in flight on it fail,
  and from then on each store is a unary ``PutCachedResponse`` (logged once,
  ``cache_put_unary``), as before the stream.

Threading: one event loop (the router's).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable

import grpc
import structlog

from llmesh.v1 import cache_pb2, cache_pb2_grpc
from services.common.grpc_util import request_id_metadata, status_code_of
from services.common.mux import MuxClient
from services.common.wire.cache import CachedResponse, CacheKey

log = structlog.get_logger()

#: Stores one message may carry (the cache's ``MAX_STORES_PER_MESSAGE``).
MAX_STORES_PER_MESSAGE = 4096
#: Bytes of stores one message carries at most (a single larger store goes
#: alone; the channels' limit is 64 MiB a message).
MAX_BYTES_PER_MESSAGE = 4 * 1024 * 1024
#: Backoff before reopening a broken call: first, and most (seconds).
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
#: Most seconds a unary store may take (a cache without the stream).
UNARY_TIMEOUT_S = 0.5

#: ``on_outcome(model, outcome)``: one store ended (``stored``, ``not_stored``,
#: ``refused``, ``failed``, ``dropped``).
OutcomeHook = Callable[[str, str], None]

_Store = cache_pb2.CachedResponseStore
_Result = cache_pb2.CachedResponseStoreResult
_StoreMux = MuxClient[_Store, _Result]


def next_backoff(previous_s: float) -> float:
    """Seconds to wait before reopening a call that broke after a wait of
    ``previous_s`` (0: none): :data:`FIRST_BACKOFF_S`, doubling to
    :data:`MAX_BACKOFF_S`."""
    return min(max(previous_s * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)


def unimplemented(why: str) -> bool:
    """Whether a call broke with UNIMPLEMENTED (``why`` as the kit's
    ``on_failed`` says it: ``"CODE: details"``): a cache older than the RPC."""
    return why.startswith(grpc.StatusCode.UNIMPLEMENTED.name)


def call_error(target: str) -> Callable[[grpc.StatusCode, str], BaseException]:
    """The kit's ``make_error`` for a cache call: a ConnectionError naming
    the cache, the code and its details."""
    return lambda code, details: ConnectionError(f"cache at {target}: {code.name}: {details}")


class _Receipt:
    """One store's receiving end on the call (a mux :class:`Receiver`)."""

    __slots__ = ("future", "model", "stream")

    def __init__(self, future: asyncio.Future[bool], model: str, stream: StoreStream) -> None:
        self.future = future
        self.model = model
        self.stream = stream

    def deliver(self, update: _Result) -> bool:
        self.stream.answered(self, update)
        return True

    def fail(self, error: BaseException) -> None:
        self.stream.settle(self, False, "failed")


def _pack(stores: list[_Store]) -> Iterable[cache_pb2.PutCachedResponsesRequest]:
    """Everything queued since the previous write, in as few messages as the
    cache takes: at most :data:`MAX_STORES_PER_MESSAGE` stores and
    :data:`MAX_BYTES_PER_MESSAGE` bytes each (a larger store goes alone), so
    that a backlog of long responses is not one message over gRPC's 64 MiB
    limit, which fails every store in it (QA: 1,000 stores of 70 KB after a
    stall, all lost as "INTERNAL: Internal error from Core")."""
    batch: list[_Store] = []
    size = 0
    for store in stores:
        store_size = store.ByteSize()
        if batch and (len(batch) == MAX_STORES_PER_MESSAGE
                      or size + store_size > MAX_BYTES_PER_MESSAGE):
            yield cache_pb2.PutCachedResponsesRequest(stores=batch)
            batch, size = [], 0
        batch.append(store)
        size += store_size
    if batch:
        yield cache_pb2.PutCachedResponsesRequest(stores=batch)


def _unpack(answer: cache_pb2.PutCachedResponsesResponse) -> Iterable[tuple[int, _Result]]:
    return ((result.store_id, result) for result in answer.results)


class StoreStream:
    """The ``PutCachedResponses`` call of one router→cache channel, opened on
    the first store and again (after a backoff) when it breaks.

    Args:
      stub: the cache service's stub on the channel.
      target: the cache's ``host:port`` (log lines).
      max_pending: the most stores waiting for their result (> 0).
      on_outcome: called once per store as it ends (metrics).
    """

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, target: str, *,
                 max_pending: int = 1024, on_outcome: OutcomeHook | None = None) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be > 0, got {max_pending}")
        self._stub = stub
        self.target = target
        self.max_pending = max_pending
        self._on_outcome = on_outcome
        self._ids = itertools.count(1)
        self._mux: _StoreMux | None = None
        #: Stores made while the call is down, for the next one.
        self._backlog: list[tuple[_Store, _Receipt]] = []
        self._reopen: asyncio.TimerHandle | None = None
        self._backoff_s = 0.0
        self._closed = False
        #: The cache has no PutCachedResponses: stores are unary calls.
        self._unary = False
        self._unary_tasks: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        """Stores waiting for their result (backlog, call, unary calls)."""
        on_call = self._mux.open_streams if self._mux is not None else 0
        return len(self._backlog) + on_call + len(self._unary_tasks)

    def put(self, key: CacheKey, response: CachedResponse, *,
            request_id: str) -> asyncio.Future[bool]:
        """Queues the store of ``response`` under ``key``; the future resolves
        True once the cache kept it, False when it did not or the store was
        lost (never raises). Does not wait."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        receipt = _Receipt(future, key.model, self)
        if self._closed or self.pending >= self.max_pending:
            self.settle(receipt, False, "dropped")
            return future
        store = _Store(store_id=next(self._ids), request_id=request_id,
                       put=cache_pb2.PutCachedResponseRequest(key=key.to_pb(),
                                                              response=response.to_pb()))
        if self._unary:
            self._put_unary(store, receipt)
            return future
        mux = self._call()
        if mux is None:
            self._backlog.append((store, receipt))
        else:
            mux.open(store.store_id, receipt, store)
        return future

    def _put_unary(self, store: _Store, receipt: _Receipt) -> None:
        """``store`` as a unary ``PutCachedResponse`` (a cache without the
        stream), in a task of its own."""

        async def put() -> None:
            try:
                reply = await self._stub.PutCachedResponse(
                    store.put, timeout=UNARY_TIMEOUT_S,
                    metadata=request_id_metadata(store.request_id))
            except grpc.aio.AioRpcError as err:
                log.warning("cache_put_failed", target=self.target, code=err.code().name,
                            details=err.details())
                self.settle(receipt, False, "failed")
                return
            self.answered(receipt, _Result(store_id=store.store_id, stored=reply.stored))

        task = asyncio.get_running_loop().create_task(put())
        self._unary_tasks.add(task)
        task.add_done_callback(self._unary_tasks.discard)

    def _call(self) -> _StoreMux | None:
        """The open call; a new one when there is none and no backoff runs;
        None while one does."""
        if self._mux is not None and self._mux.failed is None:
            return self._mux
        if self._reopen is not None:
            return None
        self._mux = MuxClient(
            self._stub.PutCachedResponses(wait_for_ready=True), pack=_pack, unpack=_unpack,
            make_error=call_error(self.target), service="cache", target=self.target,
            on_failed=self._failed)
        return self._mux

    def _failed(self, why: str) -> None:
        """The call broke: its stores fail (by the kit, after this); the next
        call opens after the backoff."""
        if self._closed:
            return
        if unimplemented(why):
            log.warning("cache_put_unary", target=self.target, why=why)
            self._unary = True
            return
        lost = self._mux.open_streams if self._mux is not None else 0
        if lost:
            log.warning("cache_put_failed", target=self.target, why=why, stores=lost)
        else:
            log.info("cache_store_call_ended", target=self.target, why=why)
        self._backoff_s = next_backoff(self._backoff_s)
        self._reopen = asyncio.get_running_loop().call_later(self._backoff_s, self._flush)

    def _flush(self) -> None:
        """Opens the next call with the backlog's stores."""
        self._reopen = None
        backlog, self._backlog = self._backlog, []
        if self._closed or not backlog:
            return  # opened by the next store
        mux = self._call()
        assert mux is not None
        for store, receipt in backlog:
            mux.open(store.store_id, receipt, store)

    def answered(self, receipt: _Receipt, result: _Result) -> None:
        """The cache's result for ``receipt``'s store."""
        self._backoff_s = 0.0
        if result.status_code:
            code = status_code_of(result.status_code)
            log.warning("cache_put_refused", target=self.target, code=code.name,
                        details=result.status_message)
            self.settle(receipt, False, "refused")
        else:
            self.settle(receipt, result.stored, "stored" if result.stored else "not_stored")

    def settle(self, receipt: _Receipt, stored: bool, outcome: str) -> None:
        """Resolves ``receipt``'s future (once) and counts ``outcome``."""
        if receipt.future.done():
            return
        receipt.future.set_result(stored)
        if self._on_outcome is not None:
            self._on_outcome(receipt.model, outcome)

    async def close(self) -> None:
        """Ends the call; stores still waiting resolve False (``failed``)."""
        self._closed = True
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        backlog, self._backlog = self._backlog, []
        for _, receipt in backlog:
            self.settle(receipt, False, "failed")
        for task in list(self._unary_tasks):
            task.cancel()
        if self._mux is not None:
            self._mux.fail("the router closed the call")  # its stores resolve False
            await self._mux.close()
