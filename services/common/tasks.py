"""Ending the background tasks a service owns."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task[object] | None) -> None:
    """Cancels ``task`` and waits until it has ended. The caller's own
    cancellation still propagates (``asyncio.wait`` does not swallow it, unlike
    suppressing ``CancelledError`` around ``await task``); an exception the task
    ended with is retrieved (no "never retrieved" warning). No-op for None."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()
