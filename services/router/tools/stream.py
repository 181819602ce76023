"""A request's event stream with its tool calls parsed out (both edges).

Each choice's :class:`~services.router.generation.Delta` text goes through its
own :class:`~.parser.ToolCallParser`: the delta then carries only content
text, and the call pieces in ``tool_calls``. A choice that made a call and
ended with STOP (EOS once the grammar accepts) ends with TOOL_CALLS; one cut
by ``max_tokens`` keeps LENGTH (its last call is incomplete, as OpenAI's and
vLLM's are; with ``tool_choice`` required or named, a call marker cut before
its end is dropped, never shown as content). Usage, ids and log-probabilities
pass unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from services.common.sampling import FinishReason
from services.router.generation import Delta, Event
from services.router.tools.parser import ToolCallParser


async def with_tool_calls(events: AsyncIterator[Event], *,
                          calls_only: bool = False) -> AsyncIterator[Event]:
    """``events`` with tool calls parsed out of each choice's text.

    Args:
      calls_only: the output is calls only (``tool_choice`` required or a
        named function): what a choice holds back at its end (the start of
        a call marker cut by ``max_tokens``) is never content.
    """
    parsers: dict[int, ToolCallParser] = {}
    try:
        async for event in events:
            parser = parsers.setdefault(event.index, ToolCallParser())
            if isinstance(event, Delta):
                text, pieces = parser.feed(event.text)
                yield dataclasses.replace(event, text=text, tool_calls=tuple(pieces))
                continue
            rest = parser.finish()
            if rest and not calls_only:
                yield Delta(rest, (), index=event.index)
            if parser.calls and event.reason is FinishReason.STOP:
                event = dataclasses.replace(event, reason=FinishReason.TOOL_CALLS)
            yield event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["with_tool_calls"]
