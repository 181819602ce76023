"""Pending updates by key, merged while no one takes them.

A :class:`Mailbox` is the kit's one merge buffer: the engine's outbox (keyed
by stream id and choice) and the router's per-request inbox (keyed by choice)
are both one. While its reader is busy (a slow client holds the writer under
HTTP/2 flow control), updates for the same key merge into one with the wire
type's merge function, so a mailbox holds at most one update per key, never a
queue of messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
U = TypeVar("U")

#: ``merge(pending, later)``: one update saying what both say (it may mutate
#: and return ``pending``, which the mailbox owns).
Merge = Callable[[U, U], U]


def never_merge(pending: U, later: U) -> U:
    """The merge of a wire type whose streams carry one update each (a unary
    answer on a multiplexed call): a second one for a key is a bug."""
    raise AssertionError("a stream of one update got two")


class Mailbox(Generic[K, U]):
    """Updates waiting to be taken, one per key, in the order each key's first
    pending update arrived."""

    __slots__ = ("_merge", "_pending", "_ready", "closed")

    def __init__(self, merge: Merge[U]) -> None:
        self._merge = merge
        self._pending: dict[K, U] = {}
        self._ready = asyncio.Event()
        #: No more updates will be put.
        self.closed = False

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, key: K, update: U) -> None:
        """Adds ``update`` (the mailbox owns it from now on), merged into
        ``key``'s pending one if there is one. Mutates."""
        pending = self._pending.get(key)
        self._pending[key] = update if pending is None else self._merge(pending, update)
        self._ready.set()

    def close(self) -> None:
        """No more updates will come: :meth:`wait` returns False once empty."""
        self.closed = True
        self._ready.set()

    async def wait(self) -> bool:
        """Waits until an update is pending (True) or the mailbox is closed and
        empty (False)."""
        while not self._pending:
            if self.closed:
                return False
            self._ready.clear()
            await self._ready.wait()
        return True

    def take_all(self) -> dict[K, U]:
        """Every pending update (possibly none), in arrival order. Mutates."""
        pending, self._pending = self._pending, {}
        return pending

    def take_first(self) -> tuple[K, U]:
        """The oldest key's pending update. Raises KeyError when empty. Mutates."""
        key = next(iter(self._pending))
        return key, self._pending.pop(key)


class StreamInbox(Generic[K, U]):
    """One stream's receiving end on a client: its updates merged per key
    until read, then how it ended (an error, after the updates before it).

    Args:
      merge: the wire type's merge function.
    """

    __slots__ = ("_mailbox", "error", "done")

    def __init__(self, merge: Merge[U]) -> None:
        self._mailbox: Mailbox[K, U] = Mailbox(merge)
        #: Why the stream failed (raised by :meth:`read` once nothing is unread).
        self.error: BaseException | None = None
        #: The other end will send nothing more.
        self.done = False

    def put(self, key: K, update: U, *, last: bool = False) -> None:
        """An update from the call; ``last``: the stream's last. Mutates."""
        self._mailbox.put(key, update)
        if last:
            self.done = True

    def fail(self, error: BaseException) -> None:
        """Ends the stream with ``error`` unless it has ended. Mutates."""
        if not self.done:
            self.error, self.done = error, True
        self._mailbox.close()

    def has_unread(self) -> bool:
        return len(self._mailbox) > 0

    async def read(self) -> tuple[K, U]:
        """The oldest key's merged updates (waits for one). Updates that came
        before an error are returned first.

        Raises:
          BaseException: :attr:`error`, once nothing is unread.
        """
        if not await self._mailbox.wait():
            assert self.error is not None, "closed without an error"
            raise self.error
        return self._mailbox.take_first()
