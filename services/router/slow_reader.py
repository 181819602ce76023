"""The slow-reader budget: a client that reads slowly, or stops reading,
holds a bounded amount of router memory and no engine KV blocks for long.

:func:`paced` runs a generation's event stream in its own task, one step
ahead of its consumer (the code that writes each event to the client: the
``Generate`` handler's ``yield``, the OpenAI endpoint's ``write``). While a
write is blocked (HTTP/2 flow control: the client's receive window is full),
the events that arrive are merged into one pending message per choice
(``merge``), so a slow client costs one growing message, not a queue of
them; it is never more than the generation's own output, itself bounded by
``max_tokens``.

The budget: a write still blocked ``write_timeout_s`` seconds after it began,
while the generation is still running, cancels the generation at once (its
task is cancelled, whose ``finally`` blocks close the engine stream: the
engine frees the sequence's KV blocks, or a shared generation loses this
subscriber), and the consumer gets :class:`WriteStalled` as soon as the
blocked write returns, in place of the rest of the output. A client that
never reads again keeps only what was already written to its transport
(its flow-control window) until its call ends (deadline, disconnect, Envoy's
stream idle timeout). A generation already complete is never cancelled: the
engine holds nothing for it any more.

Threading: asyncio only, one event loop; ``merge`` runs on the loop.

Source: the HTTP/2 flow-control model (RFC 9113 section 5.2): a sender
blocked by the peer's window holds the data; vLLM's and TGI's servers
stream without such a budget, so it is ours.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: ``--client-write-timeout-s`` default: seconds a write to a client may stay
#: blocked while its generation runs. Generous for slow networks; a client
#: that has not read for this long is not reading.
DEFAULT_CLIENT_WRITE_TIMEOUT_S = 30.0


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
                on_stall: Callable[[], None] = lambda: None) -> AsyncIterator[T]:
    """``events``, read ahead of the consumer under the slow-reader budget.

    Args:
      events: the generation's events; this function closes it (``aclose``)
        in the task that reads it.
      write_timeout_s: seconds the consumer may stay away (one write) while
        ``events`` still runs; > 0.
      merge: the event that stands for ``earlier`` then ``later`` when both
        wait for the client, or None when they must stay two events.
      on_stall: called once, at the moment the budget cancels the generation
        (e.g. to count it).

    Raises:
      WriteStalled: the budget ran out during a write (raised when it returns).
      Whatever ``events`` raised, after the events before it were consumed.
    """
    if write_timeout_s <= 0:
        raise ValueError(f"write_timeout_s must be > 0, got {write_timeout_s}")
    loop = asyncio.get_running_loop()
    ahead = _ReadAhead(events, merge)
    stalled_at: list[float] = []

    def stall() -> None:
        if not ahead.task.done():
            stalled_at.append(time.monotonic())
            ahead.task.cancel()
            on_stall()

    try:
        while (event := await ahead.next()) is not _END:
            away_from = time.monotonic()
            timer = loop.call_later(write_timeout_s, stall)
            try:
                yield event  # type: ignore[misc]
            finally:
                timer.cancel()
            if stalled_at:
                raise WriteStalled(write_timeout_s, time.monotonic() - away_from)
        if ahead.failure is not None:
            raise ahead.failure
        if ahead.task.cancelled():  # cancelled from outside (the loop is closing)
            raise asyncio.CancelledError()
    finally:
        if not ahead.task.done():
            ahead.task.cancel()
        await asyncio.wait({ahead.task})


#: What :meth:`_ReadAhead.next` returns once nothing is left.
_END = object()


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
