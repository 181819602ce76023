"""The slow-reader budget: a client that reads slowly, or stops reading,
holds a bounded amount of router memory and no engine KV blocks for long.

:func:`paced` hands a generation's events to its consumer (the code that
writes each event to the client: the ``Generate`` handler's ``yield``, the
OpenAI endpoint's ``write``). While the client reads, the events are read in
the consumer's own task, one after each write, at no cost beyond a timer per
write. From the first write that stays blocked ``read_ahead_after_s`` (50
ms; HTTP/2 flow control: the client's receive window is full), they run in
a task of their own, one step ahead of the consumer, and the events that
arrive while a write is blocked are merged into one pending message per
choice (``merge``), so a slow client costs one growing message, not a queue
of them; it is never more than the generation's own output, itself bounded
by ``max_tokens``. (Before that, the engine stream's inbox merges the
engine's updates the same way: :class:`services.router.engine_client.EngineStream`.)

The budget: a write still blocked ``write_timeout_s`` seconds after it began,
while the generation is still running, cancels the generation at once (its
read-ahead task, running by then, is cancelled, whose ``finally`` blocks
close the engine stream: the engine frees the sequence's KV blocks, or a
shared generation loses this subscriber), and the consumer gets
:class:`WriteStalled` as soon as the blocked write returns, in place of the
rest of the output. A client that never reads again keeps only what was
already written to its transport (its flow-control window) until its call
ends (deadline, disconnect, Envoy's stream idle timeout). A generation
already complete is never cancelled: the engine holds nothing for it any
more.

Threading: asyncio only, one event loop; ``merge`` runs on the loop.

Source: the HTTP/2 flow-control model (RFC 9113 section 5.2): a sender
blocked by the peer's window holds the data; vLLM's and TGI's servers
stream without such a budget, so it is ours.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: ``--client-write-timeout-s`` default: seconds a write to a client may stay
#: blocked while its generation runs. Generous for slow networks; a client
#: that has not read for this long is not reading.
DEFAULT_CLIENT_WRITE_TIMEOUT_S = 30.0


#: ``paced``'s default ``read_ahead_after_s``: a write to a client that reads
#: returns in well under this (grpc hands the message to its transport; only
#: a full HTTP/2 window holds it), so a fast client's events never pay for a
#: task of their own (one more task wake-up per event). Not less: a busy event
#: loop alone delays a write's return (16 streams in one process on this
#: 2-core VM at load 7: 64 of 64 requests had a write back after more than
#: 2 ms, 2 of 64 after more than 50 ms). A slow client loses nothing by the
#: wait: meanwhile the engine stream's inbox merges its updates.
READ_AHEAD_AFTER_S = 0.05


class WriteStalled(Exception):
    """A write to the client stayed blocked longer than the budget; the
    generation was cancelled at that moment.

    Attributes:
      budget_s: the budget (seconds).
      blocked_s: how long the write had been blocked when it returned.
    """

    def __init__(self, budget_s: float, blocked_s: float) -> None:
        super().__init__(f"a write to the client stayed blocked {blocked_s:.1f} s "
                         f"(budget {budget_s:g} s)")
        self.budget_s = budget_s
        self.blocked_s = blocked_s


async def paced(events: AsyncIterator[T], *, write_timeout_s: float,
                merge: Callable[[T, T], T | None],
                on_stall: Callable[[], None] = lambda: None,
                read_ahead_after_s: float = READ_AHEAD_AFTER_S) -> AsyncIterator[T]:
    """``events``, under the slow-reader budget: read in the consumer's own
    task while its writes return at once, and ahead of it (in a task of its
    own) from the first write that stays blocked ``read_ahead_after_s``.

    Args:
      events: the generation's events; this function closes it (``aclose``).
      write_timeout_s: seconds the consumer may stay away (one write) while
        ``events`` still runs; > 0.
      merge: the event that stands for ``earlier`` then ``later`` when both
        wait for the client, or None when they must stay two events.
      on_stall: called once, at the moment the budget cancels the generation
        (e.g. to count it).
      read_ahead_after_s: how long a write may stay blocked before the events
        are read ahead of the client (capped at half the budget).

    Raises:
      WriteStalled: the budget ran out during a write (raised when it returns).
      Whatever ``events`` raised, after the events before it were consumed.
    """
    if write_timeout_s <= 0:
        raise ValueError(f"write_timeout_s must be > 0, got {write_timeout_s}")
    pacer = _Pacer(events, merge, write_timeout_s, min(read_ahead_after_s, write_timeout_s / 2),
                   on_stall)
    try:
        while (event := await pacer.next()) is not _END:
            pacer.write_begins()
            try:
                yield event  # type: ignore[misc]
            finally:
                pacer.write_ended()
            if pacer.stalled_for is not None:
                raise WriteStalled(write_timeout_s, pacer.stalled_for)
    finally:
        await pacer.close()


#: What :meth:`_Pacer.next` returns once nothing is left.
_END = object()


class _Pacer(Generic[T]):
    """The state of one :func:`paced` stream: the read-ahead once started,
    the timer of the write under way, and whether the budget ran out."""

    def __init__(self, events: AsyncIterator[T], merge: Callable[[T, T], T | None],
                 budget_s: float, read_ahead_after_s: float,
                 on_stall: Callable[[], None]) -> None:
        self._events = events
        self._merge = merge
        self._budget_s = budget_s
        self._read_ahead_after_s = read_ahead_after_s
        self._on_stall = on_stall
        self._loop = asyncio.get_running_loop()
        self._ahead: _ReadAhead[T] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._write_began = 0.0
        #: Seconds the write had been blocked when the budget ran out (set
        #: when it returns), None while it has not.
        self.stalled_for: float | None = None
        self._stalled = False

    async def next(self) -> T | object:
        """The next event (waits for it), or :data:`_END`.

        Raises:
          Whatever ``events`` raised; CancelledError when the read-ahead was
          cancelled from outside (the loop is closing)."""
        ahead = self._ahead
        if ahead is None:
            try:
                return await anext(self._events)
            except StopAsyncIteration:
                return _END
        event = await ahead.next()
        if event is _END:
            if ahead.failure is not None:
                raise ahead.failure
            if ahead.task.cancelled() and not self._stalled:
                raise asyncio.CancelledError()
        return event

    def write_begins(self) -> None:
        """The consumer took an event: its write (its time away) starts now."""
        self._write_began = self._loop.time()
        if self._ahead is None:
            self._timer = self._loop.call_later(self._read_ahead_after_s, self._slow_write)
        else:
            self._timer = self._loop.call_later(self._budget_s, self._stall)

    def write_ended(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stalled and self.stalled_for is None:
            self.stalled_for = self._loop.time() - self._write_began

    def _slow_write(self) -> None:
        """The write is still blocked: read ahead of the client from now on,
        and keep timing this write against the budget."""
        self._ahead = _ReadAhead(self._events, self._merge)
        self._timer = self._loop.call_at(self._write_began + self._budget_s, self._stall)

    def _stall(self) -> None:
        self._timer = None
        ahead = self._ahead
        if ahead is not None and not ahead.task.done():  # the generation still runs
            self._stalled = True
            ahead.task.cancel()
            self._on_stall()

    async def close(self) -> None:
        """Ends the read-ahead (if any) and closes ``events``."""
        if self._timer is not None:
            self._timer.cancel()
        if self._ahead is not None:
            if not self._ahead.task.done():
                self._ahead.task.cancel()
            await asyncio.wait({self._ahead.task})
        # a no-op when the read-ahead closed it; else it never ran, or never began
        await self._events.aclose()  # type: ignore[attr-defined]


class _ReadAhead(Generic[T]):
    """Reads ``events`` in a task of its own (``task``) into a queue, merging
    an event into the one before it when ``merge`` says so. Closes ``events``
    in that task; an exception ``events`` raised is kept in ``failure``."""

    def __init__(self, events: AsyncIterator[T], merge: Callable[[T, T], T | None]) -> None:
        self._pending: collections.deque[T] = collections.deque()
        self._ready = asyncio.Event()
        self.failure: Exception | None = None
        self.task = asyncio.get_running_loop().create_task(self._produce(events, merge))

    async def _produce(self, events: AsyncIterator[T],
                       merge: Callable[[T, T], T | None]) -> None:
        pending = self._pending
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    merged = merge(pending[-1], event) if pending else None
                    if merged is None:
                        pending.append(event)
                    else:
                        pending[-1] = merged
                    self._ready.set()
        except Exception as err:  # noqa: BLE001 - handed to the consumer
            self.failure = err
        finally:
            self._ready.set()

    async def next(self) -> T | object:
        """The oldest waiting event (waits for one), or :data:`_END` once the
        task ended (done, failed or cancelled) and none is left."""
        while not self._pending:
            if self.task.done():
                return _END
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popleft()
