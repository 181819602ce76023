"""One request's deltas read as an async iterator (:class:`DeltaStream`).

The adapter for callers that read one request at a time
(:meth:`EngineBackend.generate <services.engine.backend.EngineBackend.generate>`:
the deprecated ``Generate`` RPC, tests, benchmarks) over the same delivery the
``Multiplex`` outbox takes: the backend hands the deltas to this sink, and the
kit's one merge buffer (:class:`services.common.mux.StreamInbox`, a
:class:`~services.common.mux.Mailbox`) holds them, merged per choice with
:func:`~services.engine.types.merge_deltas` while the reader is busy, so a slow
reader holds at most one pending delta per choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.common.mux import StreamInbox
from services.engine.types import TokenDelta, merge_deltas


class DeltaStream:
    """A :class:`~services.engine.backend.DeltaSink` that is read as an async
    iterator of the request's deltas, ending after its last choice's last.

    Args:
      n: the request's choices (``sampling.n``); each ends with its own last delta.
      loop: the event loop it lives on (where the backend calls it).
    """

    __slots__ = ("_inbox", "_unread", "loop")

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._inbox: StreamInbox[int, TokenDelta] = StreamInbox(merge_deltas)
        self._unread = n  # choices whose last delta was not read yet

    @property
    def ended(self) -> bool:
        """Every choice's last delta was read, or the stream failed."""
        return not self._unread or self._inbox.error is not None

    def deliver(self, delta: TokenDelta) -> None:
        """Takes a delta from the backend (merged into its choice's pending one). Mutates."""
        self._inbox.put(delta.index, delta)

    def fail(self, error: Exception) -> None:
        """Ends the stream with ``error``, raised once the deltas before it are read."""
        self._inbox.fail(error)

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        """The deltas, each choice's pending ones merged into one, in order of
        each choice's first pending delta.

        Raises:
          Exception: what :meth:`fail` was given, after the deltas before it.
        """
        while self._unread:
            _, delta = await self._inbox.read()
            self._unread -= delta.finished
            yield delta
