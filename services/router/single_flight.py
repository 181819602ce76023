"""Request coalescing (single flight): identical deterministic requests share
one generation.

Who coalesces: a request whose output is a function of its input (greedy, or
seeded: ``SamplingOptions.deterministic``) and that does not set
``bypass_cache`` ("compute fresh"), whether or not a response cache is
configured. Two such requests are identical when their
:class:`CoalescingKey` values are equal:

* ``model``;
* ``prompt_token_ids``: after the chat template (so ``allow_special_tokens``,
  the chat history and prompt-vs-chat input are covered by the ids they
  produced; nothing else in the request changes what the router sends or
  shows);
* ``sampling``: the whole :class:`SamplingOptions`, with ``max_tokens``
  already fitted to the context window, so stop strings, stop token ids and
  ``ignore_eos`` are in it;
* ``speculative``: lossless in exact arithmetic, but a verify step's batched
  forward may differ from a plain step in the last bits, so requests with
  different switches are not merged;
* ``priority``: the shared generation is admitted and scheduled in one traffic
  class; an interactive request never waits in the batch class behind a
  batch leader;
* ``cache_scope``: the request's cache scope (:mod:`services.common.cache_scope`:
  the tenant, or the cache group its key opts into, and the request's
  ``cache_salt``): a request never shares another scope's generation, so
  whether it was coalesced (its timing, ``cached_prompt_tokens``) tells
  nothing of what another tenant sent.

Not in the key: the request id and the tenant itself (within a scope the
engine and admission see the leader's: a follower costs the engine nothing,
so it draws on no fair share), and ``bypass_cache``.

Lifecycle. :meth:`SingleFlight.join` finds the identical generation in flight
and subscribes to it (the follower); otherwise the request calls
:meth:`SingleFlight.start` (the leader): the shared generation (:class:`Flight`)
runs ``work`` in a task of its own, never in a subscriber's consumer, and
buffers every event. Each :class:`Subscription` (the leader's is just the
first) replays the buffer from the start, then follows live; when it reaches
the last event it ends. Both calls are synchronous: between a miss in the
table and the registration nothing else runs, so requests that arrive
together all join one generation.

* End: a flight leaves the table in the same step as its work ends (its last
  event buffered, or its failure stored): a later identical request starts a
  new flight (the pipeline's work then looks the response cache up; the
  store of the answer was registered before its final event, so that lookup
  waits for it and hits). Never a double generation for requests that arrive
  while one is in flight, and never a hang: a subscriber waits only for a
  flight whose task is running, and a task that ends for any reason wakes
  its subscribers.
* Leaving: a subscriber that stops early (its client cancelled or went away,
  its deadline passed) unsubscribes; the generation continues for the
  others. When the last one leaves, the flight leaves the table and its task
  is cancelled at once (the pipeline's ``finally`` blocks close the engine
  stream: the engine frees the sequence, as when a lone client leaves).
* Failure: the work's exception is stored; every subscriber, present or
  joining before the flight left the table, raises ``clone(error)``: an
  equivalent exception (for the pipeline: a :class:`GenerationError` with
  the same code, message and trailing metadata), never the same object
  shared between tasks.
* Deadlines: each subscriber ends at its own deadline: a wait past it raises
  :class:`DeadlinePassed` (the pipeline says DEADLINE_EXCEEDED, as for a lone
  request). The work itself runs with no deadline of its own (the engine
  stream is opened without one), except while :meth:`Flight.bound_by` says a
  step of it is bound to one (the pipeline's admission wait, which refuses
  or times out by the deadline it was given). A follower joins only when the
  work cannot end for a deadline reason before its own deadline: nothing
  binds the work, or the bound is at or after the follower's deadline;
  otherwise it starts a flight of its own, which replaces the first in the
  table (the first runs on for its subscribers). A subscriber whose
  deadline is the bound itself lets the work's status speak (e.g. "deadline
  passed in the router's queue"). With no deadline of its own the
  generation ends for deadline reasons only when its last subscriber's
  deadline passes (that subscriber leaves, then no one is left).
* ``asyncio.CancelledError`` is never swallowed: a cancelled subscriber
  leaves and re-raises; the flight's task ends cancelled.

Memory: a flight holds the events of one generation (at most its output),
released when the flight is dropped; the table holds running flights only.

Threading: one event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.common.sampling import Priority, SamplingOptions, SpeculativeOptions

E = TypeVar("E")  # the events of a generation
S = TypeVar("S")  # what the caller keeps beside a flight


@dataclass(frozen=True)
class CoalescingKey:
    """Everything that decides the events of a deterministic request (see the module doc)."""

    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    speculative: SpeculativeOptions
    priority: Priority
    cache_scope: str = ""


class DeadlinePassed(Exception):
    """The subscriber's own deadline passed while it waited for the next event."""


class Flight(Generic[E, S]):
    """One shared generation: its task, its buffered events and its subscribers.

    Attributes:
      key: the coalescing key it is registered under.
      state: the caller's values for it (e.g. the generation's own progress).
      work_deadline: the deadline a step of the work is bound to now, or None
        when no deadline can end the work (see :meth:`bound_by`).
    """

    def __init__(self, registry: SingleFlight[E, S], key: Hashable, state: S) -> None:
        self.key = key
        self.state = state
        self.work_deadline: float | None = None
        self._registry = registry
        self._events: list[E] = []
        self._error: Exception | None = None
        self._done = False  # the work ended: every event is buffered, or it failed
        self._changed = asyncio.Event()
        self._subscribers: dict[Subscription[E, S], float | None] = {}
        self.task: asyncio.Task[None] | None = None

    # ---- for the work ------------------------------------------------------------------

    def latest_deadline(self) -> float | None:
        """The latest deadline among the subscribers, None when one has none."""
        deadlines = list(self._subscribers.values())
        if not deadlines or any(d is None for d in deadlines):
            return None
        return max(d for d in deadlines if d is not None)

    @contextlib.contextmanager
    def bound_by(self, deadline: float | None) -> Iterator[None]:
        """Marks a step of the work that ends at ``deadline`` (None: it cannot end
        for a deadline): followers with a later deadline do not join meanwhile,
        and subscribers whose deadline is ``deadline`` or later wait for the
        work's own status instead of their clocks."""
        self.work_deadline = deadline
        self._notify()
        try:
            yield
        finally:
            self.work_deadline = None
            self._notify()

    # ---- for the registry and the subscriptions ----------------------------------------

    def admits(self, deadline: float | None) -> bool:
        """Whether a follower with ``deadline`` may join: the work cannot end for
        a deadline reason before it."""
        if self._done:
            return False
        bound = self.work_deadline
        return bound is None or (deadline is not None and deadline <= bound)

    def subscribe(self, deadline: float | None) -> Subscription[E, S]:
        subscription = Subscription(self, deadline)
        self._subscribers[subscription] = deadline
        return subscription

    def _leave(self, subscription: Subscription[E, S]) -> None:
        self._subscribers.pop(subscription, None)
        if not self._subscribers and not self._done:
            self._registry._forget(self)
            if self.task is not None:
                self.task.cancel()

    def _publish(self, event: E) -> None:
        self._events.append(event)
        self._notify()

    def _end(self, error: Exception | None) -> None:
        """The work ended (``error``: how it failed); idempotent."""
        if self._done:
            return
        self._done = True
        self._error = error
        self._registry._forget(self)
        self._notify()

    def _notify(self) -> None:
        # A fresh Event per change: each waiter captured the one it waits on, so
        # a wake-up between its check and its wait cannot be lost.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait(self, until: float | None) -> None:
        """Waits for the next change; raises TimeoutError at ``until``
        (``time.monotonic()`` seconds) if given."""
        changed = self._changed
        if until is None:
            await changed.wait()
            return
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(loop.time() + (until - time.monotonic())):
            await changed.wait()


class Subscription(Generic[E, S]):
    """One subscriber's view of a flight: every event from the first, then live.

    Iterate it with ``async for``; :meth:`aclose` (or ``contextlib.aclosing``)
    unsubscribes, and so does reaching the end or an error.

    Raises (from iteration):
      DeadlinePassed: the subscriber's deadline passed while it waited.
      Exception: ``clone`` of the flight's failure.
    """

    def __init__(self, flight: Flight[E, S], deadline: float | None) -> None:
        self.flight = flight
        self.deadline = deadline
        self._next = 0
        self._left = False

    def __aiter__(self) -> Subscription[E, S]:
        return self

    async def __anext__(self) -> E:
        flight = self.flight
        while self._next == len(flight._events):
            if flight._done:
                self.close()
                if flight._error is not None:
                    raise flight._registry._clone(flight._error)
                raise StopAsyncIteration
            try:
                await flight._wait(self._clock())
            except TimeoutError:
                self.close()
                raise DeadlinePassed() from None
        event = flight._events[self._next]
        self._next += 1
        return event

    def _clock(self) -> float | None:
        """The deadline this subscriber's own clock enforces now: none when the
        work is bound to a deadline at or before it (the work's status comes first)."""
        bound = self.flight.work_deadline
        if self.deadline is None or (bound is not None and bound <= self.deadline):
            return None
        return self.deadline

    def close(self) -> None:
        """Unsubscribes (idempotent); the last subscriber to leave cancels the work."""
        if not self._left:
            self._left = True
            self.flight._leave(self)

    async def aclose(self) -> None:
        self.close()


class SingleFlight(Generic[E, S]):
    """The shared generations in flight, by coalescing key (see the module doc).

    Args:
      clone: makes, from the work's failure, the exception each subscriber
        raises (a fresh, equivalent one each time).
      stopped: the failure of a flight cancelled while subscribers remained
        (only :meth:`close` does that).
    """

    def __init__(self, *, clone: Callable[[Exception], Exception],
                 stopped: Callable[[], Exception]) -> None:
        self._clone = clone
        self._stopped = stopped
        self._flights: dict[Hashable, Flight[E, S]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Flights in the table (running, and joinable by key)."""
        return len(self._flights)

    def join(self, key: Hashable, deadline: float | None) -> Subscription[E, S] | None:
        """Subscribes to the flight of ``key`` when there is one that admits
        ``deadline`` (:meth:`Flight.admits`), else returns None."""
        flight = self._flights.get(key)
        if flight is None or not flight.admits(deadline):
            return None
        return flight.subscribe(deadline)

    def start(self, key: Hashable, deadline: float | None, state: S,
              work: Callable[[Flight[E, S]], AsyncIterator[E]]) -> Subscription[E, S]:
        """Starts ``work(flight)`` in its own task (in a copy of the current
        context), registers the flight under ``key`` (replacing one that did
        not admit the caller) and returns the caller's subscription."""
        flight: Flight[E, S] = Flight(self, key, state)
        subscription = flight.subscribe(deadline)
        self._flights[key] = flight
        task = asyncio.get_running_loop().create_task(self._run(flight, work(flight)))
        flight.task = task
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(flight, t))
        return subscription

    async def close(self) -> None:
        """Cancels the flights still running and waits for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # ------------------------------------------------------------------ internals

    async def _run(self, flight: Flight[E, S], events: AsyncIterator[E]) -> None:
        error: Exception | None = None
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    flight._publish(event)
        except Exception as err:  # noqa: BLE001 - stored for every subscriber
            error = err
        flight._end(error)

    def _task_done(self, flight: Flight[E, S], task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not flight._done:
            # Cancelled (the last subscriber left, or close()), perhaps before it
            # ran: whoever still waits gets a status instead of waiting forever.
            flight._end(self._stopped())

    def _forget(self, flight: Flight[E, S]) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]


__all__ = ["CoalescingKey", "DeadlinePassed", "Flight", "SingleFlight", "Subscription"]
