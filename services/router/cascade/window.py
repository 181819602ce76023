"""The held-back window: a generation's first ``k`` tokens kept from the client.

:func:`hold` reads a generation's events until ``k`` tokens have come (or
its :class:`~services.router.generation.Finished`), keeping all of them;
nothing of them reaches the client until the caller releases the window
(:meth:`Window.released`) or drops it with the generation. The same
generation's later events are read from the same iterator afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.common.logprobs import PositionLogprobs
from services.router.generation import Delta, Event, Finished


@dataclass
class Window:
    """The events held back so far.

    Attributes:
      events: in order; the last may be the generation's Finished.
      tokens: token ids among them.
    """

    events: list[Event] = field(default_factory=list)
    tokens: int = 0

    @property
    def finished(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], Finished)

    def logprobs(self, k: int) -> tuple[PositionLogprobs, ...]:
        """The first ``k`` positions' logprobs, in order."""
        entries = [p for e in self.events if isinstance(e, Delta) for p in e.logprobs]
        return tuple(entries[:k])

    def released(self, client_logprobs: int | None) -> list[Event]:
        """The events as the client may see them: logprobs it did not ask
        for removed (:func:`for_client`)."""
        return [for_client(e, client_logprobs) for e in self.events]


async def hold(events: AsyncIterator[Event], k: int) -> Window:
    """Reads ``events`` until ``k`` tokens or a Finished; the rest stays unread."""
    window = Window()
    async for event in events:
        window.events.append(event)
        if isinstance(event, Finished):
            break
        window.tokens += len(event.token_ids)
        if window.tokens >= k:
            break
    return window


def for_client(event: Event, client_logprobs: int | None) -> Event:
    """``event`` without the logprobs the cascade asked for internally: none
    when the client asked for none (``client_logprobs`` None), else each
    position's alternatives cut to the client's count."""
    if not isinstance(event, Delta) or not event.logprobs:
        return event
    if client_logprobs is None:
        return dataclasses.replace(event, logprobs=())
    return dataclasses.replace(event, logprobs=tuple(
        dataclasses.replace(p, top=p.top[:client_logprobs]) for p in event.logprobs))


__all__ = ["Window", "for_client", "hold"]
