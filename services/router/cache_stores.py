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
* a draining cache refuses each new call (UNAVAILABLE with the details
  :data:`~services.common.wire.cache.DRAINING`) before reading anything. So
  once the cache has signalled a drain (it ended a call OK, or refused one
  so) and until it answers a store again, a call that fails unanswered
  was never read: its stores go back to the backlog for the next call
  (logged ``cache_store_call_refused``), which lands on another replica or
  on the restarted cache, instead of being lost for as long as the drain
  lasts (for :data:`RESEND_WINDOW_S` after their ``put`` at most). The
  status is not enough by itself: a write racing the refusal can end the
  call INTERNAL "Internal error from Core" instead;
* a store left unanswered for ``timeout_s`` after its message went to the
  call (stall detection, not latency: by default 4 times the router's
  ``--cache-timeout``, at least 5 s, :func:`store_timeout_for`, so that a
  store the cache answers late because Redis was slow for the cache's own
  timeout, 0.5 s, counts as the cache answered it, e.g. ``not_stored``), on
  a connected channel, while the cache answered no store at all for as long
  (a cache that accepted the call and stalled, or stopped reading it),
  resolves False, counted ``timed_out``; the call is given up (its other stores fail, one
  ``cache_put_failed`` warning naming the timeout) and the next store opens
  a new one after the backoff. A store queued behind others on a call that
  answers (a long backlog after a restart) waits its turn. While the
  channel is not connected the clock restarts: a store waits for a cache
  that is down and gets a full ``timeout_s`` once it is back (so a store
  sent as the channel connects may take up to twice ``timeout_s``);
* at most ``max_pending`` stores wait (in the backlog or unanswered on the
  call): more are dropped at once (their future False, counted ``dropped``),
  so a cache that is down or stalled costs bounded memory;
* a store the cache refuses (its result carries INVALID_ARGUMENT or
  FAILED_PRECONDITION: a router bug) resolves False, logged
  ``cache_put_refused`` and counted ``refused``;
* a cache older than ``PutCachedResponses`` (the call ends UNIMPLEMENTED,
  e.g. mid-way through a rolling upgrade): the stores in flight on it fail,
  and for :data:`UNARY_FOR_S` each store is a unary ``PutCachedResponse``
  (logged ``cache_put_unary``), as before the stream; then the next store
  tries a call again (the cache may have been upgraded meanwhile).

Threading: one event loop (the router's).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Iterable

import grpc
import structlog

from llmesh.v1 import cache_pb2, cache_pb2_grpc
from services.common.grpc_util import request_id_metadata, status_code_of
from services.common.mux import MuxClient
from services.common.wire.cache import DRAINING, CachedResponse, CacheKey

log = structlog.get_logger()

#: Stores one message may carry (the cache's ``MAX_STORES_PER_MESSAGE``).
MAX_STORES_PER_MESSAGE = 4096
#: Bytes of stores one message carries at most (a single larger store goes
#: alone; the channels' limit is 64 MiB a message).
MAX_BYTES_PER_MESSAGE = 4 * 1024 * 1024
#: The least seconds a store may go unanswered on a connected channel
#: before the call is given up (:func:`store_timeout_for`).
MIN_STORE_TIMEOUT_S = 5.0
#: Backoff before reopening a broken call: first, and most (seconds).
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
#: Most seconds after its ``put`` a store refused by a draining cache is sent
#: again (longer than a cache's default drain, ``--drain-seconds`` 10); an
#: older one resolves False (``failed``), so a cache stuck draining cannot
#: hold stores for ever.
RESEND_WINDOW_S = 30.0
#: Seconds a cache that has no stream RPC (the call ended UNIMPLEMENTED: an
#: older cache) gets unary calls before the next lookup or store tries the
#: stream again: a rolling upgrade gives the router the stream back without
#: a restart (read at each break, so tests may patch it).
UNARY_FOR_S = 30.0
#: How a draining cache's refusal of a new call reads (MuxClient: "CODE: details").
_REFUSED_DRAINING = f"{grpc.StatusCode.UNAVAILABLE.name}: {DRAINING}"
#: How the kit reports a call the cache ended OK, which it does only when a
#: drain begins (:meth:`services.cache.service.CacheService.drain`).
_ENDED_BY_CACHE = "the cache ended the Multiplex call"
#: The start of the reason the router gives up a stalled call with.
_NO_ANSWER = "no answer to a store within"

#: ``on_outcome(model, outcome)``: one store ended (``stored``, ``not_stored``,
#: ``refused``, ``failed``, ``timed_out``, ``dropped``).
OutcomeHook = Callable[[str, str], None]

_Store = cache_pb2.CachedResponseStore
_Result = cache_pb2.CachedResponseStoreResult


def next_backoff(previous_s: float) -> float:
    """Seconds to wait before reopening a call that broke after a wait of
    ``previous_s`` (0: none): :data:`FIRST_BACKOFF_S`, doubling to
    :data:`MAX_BACKOFF_S`."""
    return min(max(previous_s * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)


def store_timeout_for(cache_timeout_s: float) -> float:
    """The stores' answer timeout (seconds) of a router whose cache calls
    take at most ``cache_timeout_s`` (``--cache-timeout``): 4 times it, at
    least :data:`MIN_STORE_TIMEOUT_S`. Stall detection, not a latency bound:
    the cache's own Redis timeout (``--redis-timeout-seconds``, 0.5 s) must
    end a slow store first, so the router counts the cache's answer."""
    return max(MIN_STORE_TIMEOUT_S, 4 * cache_timeout_s)


def call_status(why: str) -> str:
    """The status a call broke with, ``"CODE: details"``, from ``why`` as the
    kit's ``on_failed`` says it (the reader's ``"CODE: details"``, or the
    writer's ``"writing to it failed: CODE: details"`` when it met the status
    first)."""
    return why.removeprefix("writing to it failed: ")


def unimplemented(why: str) -> bool:
    """Whether a call broke with UNIMPLEMENTED (``why`` as :func:`call_status`
    reads it): a cache older than the RPC."""
    return call_status(why).startswith(grpc.StatusCode.UNIMPLEMENTED.name)


def call_error(target: str) -> Callable[[grpc.StatusCode, str], BaseException]:
    """The kit's ``make_error`` for a cache call: a ConnectionError naming
    the cache, the code and its details."""
    return lambda code, details: ConnectionError(f"cache at {target}: {code.name}: {details}")


class _Receipt:
    """One store's receiving end on the call (a mux :class:`Receiver`).

    Attributes:
      future: True once the cache kept the store, False otherwise.
      model: the key's model (metrics).
      store: the store message (sent again after a draining cache's refusal).
      born: the loop's time at ``put`` (seconds).
      timer: the store's answer timeout while it is on a call, else None.
      was_connected: the channel was connected when ``timer`` was armed.
    """

    __slots__ = ("born", "future", "model", "store", "stream", "timer", "was_connected")

    def __init__(self, future: asyncio.Future[bool], model: str, stream: StoreStream) -> None:
        self.future = future
        self.model = model
        self.stream = stream
        self.store: _Store | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.was_connected = False
        self.born = future.get_loop().time()

    def deliver(self, update: _Result) -> bool:
        self.stream.answered(self, update)
        return True

    def fail(self, error: BaseException) -> None:
        self.stream.lost(self)

    def disarm(self) -> None:
        """Cancels the answer timeout (answered, settled or off the call)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


#: The call's items are the receipts (each holds its store).
_StoreMux = MuxClient[_Receipt, _Result]


def _batches(receipts: list[_Receipt]) -> Iterable[list[_Receipt]]:
    """Everything queued since the previous write, in as few messages as the
    cache takes: at most :data:`MAX_STORES_PER_MESSAGE` stores and
    :data:`MAX_BYTES_PER_MESSAGE` bytes each (a larger store goes alone), so
    that a backlog of long responses is not one message over gRPC's 64 MiB
    limit, which fails every store in it (QA: 1,000 stores of 70 KB after a
    stall, all lost as "INTERNAL: Internal error from Core")."""
    batch: list[_Receipt] = []
    size = 0
    for receipt in receipts:
        assert receipt.store is not None
        store_size = receipt.store.ByteSize()
        if batch and (len(batch) == MAX_STORES_PER_MESSAGE
                      or size + store_size > MAX_BYTES_PER_MESSAGE):
            yield batch
            batch, size = [], 0
        batch.append(receipt)
        size += store_size
    if batch:
        yield batch


def _unpack(answer: cache_pb2.PutCachedResponsesResponse) -> Iterable[tuple[int, _Result]]:
    return ((result.store_id, result) for result in answer.results)


class StoreStream:
    """The ``PutCachedResponses`` call of one router→cache channel, opened on
    the first store and again (after a backoff) when it breaks.

    Args:
      stub: the cache service's stub on the channel.
      target: the cache's ``host:port`` (log lines).
      timeout_s: the most seconds a store on the call may go unanswered while
        the channel is connected (> 0; :func:`store_timeout_for`); also a
        unary store's timeout.
      connected: whether the channel is connected now (READY).
      max_pending: the most stores waiting for their result (> 0).
      on_outcome: called once per store as it ends (metrics).
    """

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, target: str, *,
                 timeout_s: float = MIN_STORE_TIMEOUT_S,
                 connected: Callable[[], bool] = lambda: True, max_pending: int = 1024,
                 on_outcome: OutcomeHook | None = None) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be > 0, got {max_pending}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._stub = stub
        self.target = target
        self.timeout_s = timeout_s
        self._connected = connected
        self.max_pending = max_pending
        self._on_outcome = on_outcome
        self._ids = itertools.count(1)
        self._mux: _StoreMux | None = None
        #: Stores made while the call is down, for the next one.
        self._backlog: list[_Receipt] = []
        #: The cache signalled a drain and has answered no store since.
        self._draining = False
        #: The last call to fail was never read (the cache drains): its
        #: stores go back to the backlog.
        self._resend = False
        self._reopen: asyncio.TimerHandle | None = None
        self._backoff_s = 0.0
        #: The loop's time of the latest answer (seconds).
        self._answered_at = -math.inf
        self._closed = False
        #: The loop's time until which stores are unary calls (the cache has
        #: no PutCachedResponses).
        self._unary_until = -math.inf
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
        receipt.store = _Store(
            store_id=next(self._ids), request_id=request_id,
            put=cache_pb2.PutCachedResponseRequest(key=key.to_pb(), response=response.to_pb()))
        if future.get_loop().time() < self._unary_until:
            self._put_unary(receipt.store, receipt)
        else:
            self._send([receipt])
        return future

    def _send(self, receipts: list[_Receipt]) -> None:
        """Opens each receipt's store on the call (its answer timeout is armed
        as it is written: :meth:`_pack`); into the backlog while a backoff runs."""
        mux = self._call()
        if mux is None:
            self._backlog.extend(receipts)
            return
        for receipt in receipts:
            assert receipt.store is not None
            mux.open(receipt.store.store_id, receipt, receipt)

    def _pack(self, receipts: list[_Receipt]) -> Iterable[cache_pb2.PutCachedResponsesRequest]:
        """The call's messages (:func:`_batches`), each store's answer timeout
        armed as its message goes to the call: the writer takes one message
        at a time, so the time the router spends building and writing a
        backlog does not count against the stores behind it."""
        for batch in _batches(receipts):
            for receipt in batch:
                self._arm(receipt)
            yield cache_pb2.PutCachedResponsesRequest(stores=[r.store for r in batch])

    def _arm(self, receipt: _Receipt, delay_s: float | None = None) -> None:
        """Starts (again) ``receipt``'s answer timeout: :attr:`timeout_s`, or
        ``delay_s`` seconds."""
        receipt.was_connected = self._connected()
        receipt.timer = asyncio.get_running_loop().call_later(
            self.timeout_s if delay_s is None else delay_s, self._expired, receipt)

    def _expired(self, receipt: _Receipt) -> None:
        """``receipt``'s timeout ran out. While the channel was connected
        throughout (as far as its two ends show) and the cache answered
        nothing for :attr:`timeout_s`, the store resolves False
        (``timed_out``) and the call is given up. Else the clock runs on: from
        the latest answer (the store waits its turn behind others), or afresh
        (the call waits for the cache to be reachable)."""
        receipt.timer = None
        if receipt.future.done():
            return
        if not (receipt.was_connected and self._connected()):
            self._arm(receipt)
            return
        quiet_s = asyncio.get_running_loop().time() - self._answered_at
        if quiet_s < self.timeout_s:
            self._arm(receipt, self.timeout_s - quiet_s)
            return
        self.settle(receipt, False, "timed_out")
        if self._mux is not None and self._mux.failed is None:
            self._mux.fail(f"{_NO_ANSWER} {self.timeout_s:g} s")

    def _put_unary(self, store: _Store, receipt: _Receipt) -> None:
        """``store`` as a unary ``PutCachedResponse`` (a cache without the
        stream), in a task of its own."""

        async def put() -> None:
            try:
                reply = await self._stub.PutCachedResponse(
                    store.put, timeout=self.timeout_s,
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
            self._stub.PutCachedResponses(wait_for_ready=True), pack=self._pack, unpack=_unpack,
            make_error=call_error(self.target), service="cache", target=self.target,
            on_failed=self._failed, expected=self._resends)
        return self._mux

    def _failed(self, why: str) -> None:
        """The call broke: its stores fail (by the kit, after this); the next
        call opens after the backoff."""
        if self._closed:
            return
        self._note_drain(why)
        if unimplemented(why):
            log.warning("cache_put_unary", target=self.target, why=why, retry_in_s=UNARY_FOR_S)
            self._unary_until = asyncio.get_running_loop().time() + UNARY_FOR_S
            return
        lost = self._mux.open_streams if self._mux is not None else 0
        if self._resend:
            log.info("cache_store_call_refused", target=self.target, why=why, stores=lost)
        elif lost:
            log.warning("cache_put_failed", target=self.target, why=why, stores=lost)
        else:
            log.info("cache_store_call_ended", target=self.target, why=why)
        self._backoff_s = next_backoff(self._backoff_s)
        self._reopen = asyncio.get_running_loop().call_later(self._backoff_s, self._flush)

    def _resends(self, why: str) -> bool:
        """Whether the stores of a call that failed with ``why`` go back to
        the backlog: the call failed while the cache drains, unread (no
        state changes: the kit asks this to leave out its warning)."""
        refused = call_status(why) == _REFUSED_DRAINING
        unread = why != _ENDED_BY_CACHE and not why.startswith(_NO_ANSWER)
        return not self._closed and (refused or (self._draining and unread))

    def _note_drain(self, why: str) -> None:
        """Reads a drain into a failed call's ``why``: sets whether its stores
        go back to the backlog (:attr:`_resend`, :meth:`_resends`) and whether
        the cache drains."""
        self._resend = self._resends(why)
        self._draining = (self._draining or call_status(why) == _REFUSED_DRAINING
                          or why == _ENDED_BY_CACHE)

    def _flush(self) -> None:
        """Opens the next call with the backlog's stores."""
        self._reopen = None
        backlog, self._backlog = self._backlog, []
        if self._closed or not backlog:
            return  # opened by the next store
        self._send(backlog)

    def lost(self, receipt: _Receipt) -> None:
        """The call ended without answering ``receipt``'s store: False
        (``failed``), or back to the backlog when a draining cache refused
        the call (it read nothing) within :data:`RESEND_WINDOW_S` of its put."""
        age_s = receipt.future.get_loop().time() - receipt.born
        if self._resend and not self._closed and age_s < RESEND_WINDOW_S:
            receipt.disarm()
            self._backlog.append(receipt)
        else:
            self.settle(receipt, False, "failed")

    def answered(self, receipt: _Receipt, result: _Result) -> None:
        """The cache's result for ``receipt``'s store."""
        self._backoff_s = 0.0
        self._draining = False
        self._answered_at = receipt.future.get_loop().time()
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
        receipt.disarm()
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
        for receipt in backlog:
            self.settle(receipt, False, "failed")
        for task in list(self._unary_tasks):
            task.cancel()
        if self._mux is not None:
            self._mux.fail("the router closed the call")  # its stores resolve False
            await self._mux.close()
